"""kfac-pytorch's constructor arguments, and interlace's flat spellings, as ``KFAC``'s keywords.

:class:`~interlace.kfac.preconditioner.KFACPreconditioner` (and so ``interlace train``'s flags)
takes kfac-pytorch's names and the settings ``KFAC`` keeps inside its policy objects as plain
keywords; :func:`kfac_keywords` maps them onto ``KFAC``'s own, so that ``KFAC`` reads as K-FAC,
not as a shim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from interlace.errors import Named, OptionError, Setting
from interlace.kfac.enums import AssignmentStrategy, ComputeMethod, PlacementChoice, coerce_choice
from interlace.kfac.factor_modes import Bulk, FactorCommMode, Pipelined, factor_comm_from
from interlace.kfac.methods import EIGEN, method_from
from interlace.kfac.placements import LBP, Greedy, Placement, placement_or_auto

if TYPE_CHECKING:
    from interlace.comm.cost import CostModel
    from interlace.comm.plan import Bucketing
    from interlace.kfac.costs import DecompositionCostModel

__all__ = ["kfac_keywords"]


def kfac_keywords(
    options: Mapping[str, Any],
    *,
    allreduce_bucket_cap_mb: float | None = None,
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
    colocate_factors: bool | None = None,
    compute_eigenvalue_outer_product: bool = True,
    update_factors_in_hook: bool | None = None,
    fusion: Bucketing | str | None = None,
    profile_steps: int | None = None,
    factor_cost: CostModel | None = None,
    tune_steps: int | None = None,
    decomposition_cost: DecompositionCostModel | None = None,
    broadcast_cost: CostModel | None = None,
) -> dict[str, Any]:
    """``KFAC``'s keywords: ``options`` (its own) with the rest folded in, each with
    kfac-pytorch's meaning; a keyword left out keeps ``KFAC``'s default.

    Args:
        options: ``KFAC``'s own keywords as given (``bucket_cap_mb``, ``placement``,
            ``factor_comm`` and ``compute_method`` are read; ``bucket_cap_mb``, ``placement``
            and ``factor_comm`` are written).
        allreduce_bucket_cap_mb: kfac-pytorch's name for ``bucket_cap_mb``.
        assignment_strategy: What greedy placement balances (kfac-pytorch's
            :class:`AssignmentStrategy`): ``MEMORY`` is ``placement=Greedy(balance="memory")``.
        colocate_factors: kfac-pytorch's switch: True keeps a layer's factors on one rank
            (greedy, round-robin), False places them apart (LBP); None: as ``placement`` says.
        compute_eigenvalue_outer_product: kfac-pytorch's switch; results do not depend on it,
            but with ``eigen`` it needs colocated factors, as in kfac-pytorch.
        update_factors_in_hook: kfac-pytorch's switch: True is ``factor_comm="pipelined"``,
            False ``"bulk"``; None: as ``factor_comm`` says.
        fusion: :class:`~interlace.kfac.factor_modes.Pipelined`'s ``fusion``.
        profile_steps: :class:`~interlace.kfac.factor_modes.Pipelined`'s ``profile_steps``.
        factor_cost: :class:`~interlace.kfac.factor_modes.Pipelined`'s ``factor_cost``.
        tune_steps: :class:`~interlace.kfac.factor_modes.Pipelined`'s ``tune_steps``.
        decomposition_cost: :class:`~interlace.kfac.placements.LBP`'s ``decomposition_cost``.
        broadcast_cost: :class:`~interlace.kfac.placements.LBP`'s ``broadcast_cost``.

    Raises:
        OptionError: Options that contradict each other (naming what to write instead), or a
            switch that is not True or False.
    """
    if not isinstance(compute_eigenvalue_outer_product, bool):
        raise OptionError(
            "compute_eigenvalue_outer_product",
            f"must be True or False, got {compute_eigenvalue_outer_product!r}",
        )
    for name, switch in (
        ("colocate_factors", colocate_factors),
        ("update_factors_in_hook", update_factors_in_hook),
    ):
        if switch is not None and not isinstance(switch, bool):
            raise OptionError(name, f"must be True or False (or None: not given), got {switch!r}")
    keywords = dict(options)
    if allreduce_bucket_cap_mb is not None:
        given = keywords.get("bucket_cap_mb")
        if given is not None and given != allreduce_bucket_cap_mb:
            raise OptionError(
                "allreduce_bucket_cap_mb",
                Named("bucket_cap_mb"),
                " and ",
                Named("allreduce_bucket_cap_mb"),
                " name the same setting; pass one",
            )
        keywords["bucket_cap_mb"] = allreduce_bucket_cap_mb
    mode = _factor_comm(keywords.get("factor_comm"), update_factors_in_hook)
    base = mode if isinstance(mode, Pipelined) else Pipelined()
    # Built whatever the mode, so that a bad value is refused even where bulk ignores it.
    settings = Pipelined(
        fusion=base.fusion if fusion is None else fusion,
        profile_steps=base.profile_steps if profile_steps is None else profile_steps,
        factor_cost=base.factor_cost if factor_cost is None else factor_cost,
        tune_steps=base.tune_steps if tune_steps is None else tune_steps,
    )
    flat_given = any(
        value is not None for value in (fusion, profile_steps, factor_cost, tune_steps)
    )
    if isinstance(mode, Pipelined) or (mode is None and flat_given):
        mode = settings  # KFAC's default mode is pipelined
    if mode is not None:
        keywords["factor_comm"] = mode
    # kfac-pytorch's default method and KFAC's: eigen.
    method = method_from(keywords.get("compute_method", ComputeMethod.EIGEN))
    placement = _placement(
        keywords.get("placement"),
        coerce_choice(AssignmentStrategy, assignment_strategy, "assignment_strategy"),
        colocate_factors,
        needs_colocated=method == EIGEN and compute_eigenvalue_outer_product,
        costs=(decomposition_cost, broadcast_cost),
    )
    if placement is not None:
        keywords["placement"] = placement
    return keywords


def _factor_comm(given: object, update_factors_in_hook: bool | None) -> FactorCommMode | None:
    """The mode from ``factor_comm`` and kfac-pytorch's switch (None: neither given)."""
    mode = None if given is None else factor_comm_from(given)
    if update_factors_in_hook is None:
        return mode
    implied = Pipelined() if update_factors_in_hook else Bulk()
    if mode is not None and mode.name != implied.name:
        raise OptionError(
            "update_factors_in_hook",
            Setting("update_factors_in_hook", update_factors_in_hook),
            " means ",
            Setting("factor_comm", implied.name),
            ", but ",
            Setting("factor_comm", mode.name),
            " was given; pass one of the two",
        )
    return implied if mode is None else mode


def _placement(
    given: object,
    strategy: AssignmentStrategy,
    colocate_factors: bool | None,
    *,
    needs_colocated: bool,
    costs: tuple[DecompositionCostModel | None, CostModel | None],
) -> Placement | None:
    """The placement from ``placement`` and kfac-pytorch's switches (see :func:`kfac_keywords`);
    None: nothing asks for other than ``KFAC``'s default."""
    if colocate_factors is False and needs_colocated:
        raise OptionError(
            "colocate_factors",
            "must be True to use ",
            Named("compute_eigenvalue_outer_product"),
            "; pass ",
            Setting("compute_eigenvalue_outer_product", False),
            " with ",
            Setting("colocate_factors", False),
        )
    # "auto" (KFAC's default) is what the switches below may narrow, as if nothing was given.
    named = None if given is None else placement_or_auto(given)
    chosen = None if isinstance(named, PlacementChoice) else named
    if colocate_factors is False:
        if chosen is not None and chosen.colocated:
            raise OptionError(
                "colocate_factors",
                Setting("placement", chosen.name),
                " keeps a layer's factors on one rank, but ",
                Setting("colocate_factors", False),
                " was given; use ",
                Setting("placement", "lbp"),
                " to place them apart",
            )
        chosen = chosen or LBP()
    elif colocate_factors is True:
        if chosen is not None and not chosen.colocated:
            raise OptionError(
                "colocate_factors",
                Setting("placement", chosen.name),
                " places each factor on its own, but ",
                Setting("colocate_factors", True),
                " was given; drop ",
                Named("colocate_factors"),
                " or use ",
                Setting("placement", "greedy"),
            )
        chosen = chosen or Greedy()
    if strategy is AssignmentStrategy.MEMORY:
        chosen = chosen or Greedy()
        if not isinstance(chosen, Greedy):
            raise OptionError(
                "assignment_strategy",
                Setting("assignment_strategy", strategy.value),
                " balances greedy placement, not ",
                Setting("placement", chosen.name),
                "; use ",
                Setting("placement", "greedy"),
            )
        chosen = Greedy(balance=strategy)
    decomposition_cost, broadcast_cost = costs
    if decomposition_cost is not None or broadcast_cost is not None:
        chosen = chosen or LBP()  # the cost models price LBP's placement
        if not isinstance(chosen, LBP):
            option = "decomposition_cost" if decomposition_cost is not None else "broadcast_cost"
            raise OptionError(
                option,
                "prices LBP's placement, but ",
                Setting("placement", chosen.name),
                " was chosen; drop it or use ",
                Setting("placement", "lbp"),
            )
        chosen = replace(
            chosen,
            decomposition_cost=decomposition_cost or chosen.decomposition_cost,
            broadcast_cost=broadcast_cost or chosen.broadcast_cost,
        )
    return chosen
