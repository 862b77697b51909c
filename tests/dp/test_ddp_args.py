"""DDP's constructor arguments on DataParallel: DDP's order and meaning, or a clear refusal."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from interlace.comm.cost import CostModel
from interlace.dp import DataParallel
from interlace.dp.ddp_args import ddp_settings, move_inputs
from interlace.errors import UsageError
from interlace.testing import run_ranks

COST = CostModel(a=2e-4, b=1e-9)


def test_ddps_arguments_come_first_in_ddps_order_with_ddps_defaults() -> None:
    ddp = list(inspect.signature(DistributedDataParallel.__init__).parameters.values())
    ours = list(inspect.signature(DataParallel.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(ddp)]] == [
        (p.name, p.kind, p.default) for p in ddp
    ]
    # interlace's own arguments cannot shift DDP's positions.
    assert ours[len(ddp) :] and all(p.kind is p.KEYWORD_ONLY for p in ours[len(ddp) :])


def _settings(device: str = "cpu", **given: Any) -> Any:
    arguments: dict[str, Any] = {
        name: parameter.default
        for name, parameter in inspect.signature(ddp_settings).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    arguments.update(
        device_ids=None,
        output_device=None,
        dim=0,
        broadcast_buffers=None,
        init_sync=True,
        process_group=None,
        find_unused_parameters=False,
        check_reduction=False,
        gradient_as_bucket_view=False,
        static_graph=False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params=False,
        bucket_cap_mb_list=None,
        batched_grad_copy=False,
        forward_sync_buffers=None,
        forward_overlap=False,
    )
    arguments.update(given)
    return ddp_settings(torch.device(device), **arguments)


@pytest.mark.parametrize(
    ("given", "moved_to"),
    [
        ({}, None),
        ({"device_ids": []}, None),
        ({"device_ids": [0]}, "cuda:0"),
        ({"device_ids": [torch.device("cuda:0")], "output_device": 0}, "cuda:0"),
        ({"device_ids": ["cuda:0"], "output_device": torch.device("cuda", 0)}, "cuda:0"),
        ({"output_device": 0}, None),
    ],
)
def test_device_ids_of_the_modules_gpu_move_the_inputs_there(
    given: dict[str, Any], moved_to: str | None
) -> None:
    settings = _settings("cuda:0", **given)
    assert settings.input_device == (None if moved_to is None else torch.device(moved_to))


@pytest.mark.parametrize(
    ("device", "given", "needle"),
    [
        ("cpu", {"device_ids": [0]}, "this model is on cpu, where DDP too needs device_ids=None"),
        ("cpu", {"output_device": 0}, "output_device=None: drop them"),
        ("cuda:0", {"device_ids": [0, 1]}, "device_ids can hold one device"),
        ("cuda:0", {"device_ids": [1]}, "must name the module's device cuda:0, got cuda:1"),
        ("cuda:0", {"device_ids": [0], "output_device": 1}, "got cuda:1"),
        ("cuda:0", {"device_ids": [True]}, "device_ids must name a CUDA device"),
        ("cuda:0", {"device_ids": ["elsewhere"]}, "device_ids must name a CUDA device"),
    ],
)
def test_device_ids_elsewhere_are_refused(device: str, given: dict[str, Any], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        _settings(device, **given)


def test_inputs_move_with_their_structure() -> None:
    inputs = (torch.ones(2), [torch.zeros(1), "text"])
    kwargs = {"mask": {"a": torch.ones(3)}, "n": 4}
    moved, moved_kwargs = move_inputs(inputs, kwargs, torch.device("meta"))
    assert moved[0].device.type == "meta" and moved[1][0].device.type == "meta"
    assert moved[1][1] == "text" and moved_kwargs["n"] == 4
    assert moved_kwargs["mask"]["a"].device.type == "meta"


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ({"dim": 1}, "dim=1: DDP's dim is the dimension along which inputs are scattered"),
        ({"dim": "0"}, "dim must be an integer"),
        ({"mixed_precision": object()}, "use torch.autocast|forward under torch.autocast"),
        (
            {"delay_all_reduce_named_params": [("weight", None)]},
            "delay_all_reduce_named_params and param_to_hook_all_reduce schedule",
        ),
        ({"param_to_hook_all_reduce": nn.Parameter(torch.ones(1))}, "drop both"),
        ({"bucket_cap_mb_list": [1, 25]}, "bucket_cap_mb_list sets a cap per bucket"),
        ({"find_unused_parameters": 1}, "find_unused_parameters must be True or False"),
        ({"static_graph": None}, "static_graph must be True or False"),
        ({"gradient_as_bucket_view": "yes"}, "gradient_as_bucket_view must be True or False"),
        ({"init_sync": 0}, "init_sync must be True or False"),
        ({"forward_sync_buffers": 1}, "forward_sync_buffers must be True or False"),
        ({"broadcast_buffers": "no"}, "broadcast_buffers must be True or False"),
        (
            {"gradient_as_bucket_view": True, "overlap": "forward"},
            "gradient_as_bucket_view cannot be combined with overlap='forward'",
        ),
    ],
)
def test_arguments_that_cannot_apply_are_refused_in_one_line(
    given: dict[str, Any], needle: str
) -> None:
    # Refused before the process group is needed: no ranks to start.
    with pytest.raises(UsageError, match=needle) as refused:
        DataParallel(nn.Linear(2, 2), **given)
    assert "\n" not in str(refused.value)


def test_check_reduction_warns_as_in_ddp() -> None:
    with (
        pytest.warns(FutureWarning, match="check_reduction"),
        pytest.raises(UsageError, match="init_process_group"),
    ):
        DataParallel(nn.Linear(2, 2), check_reduction=True)


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(1))
        self.seen = torch.zeros(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.count.clone()  # what this forward started from
        self.count += x.sum()
        out: torch.Tensor = self.linear(x)
        return out


def _rank_specific_model() -> WithBuffer:
    torch.manual_seed(dist.get_rank())
    model = WithBuffer()
    model.count.fill_(10 * dist.get_rank())
    return model


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _spread(tensor: torch.Tensor) -> float:
    """The largest difference between this rank's ``tensor`` and any other rank's."""
    gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return max(float((other - tensor).abs().max()) for other in gathered)


def _wrap_time_sync() -> dict[str, Any]:
    """What each way of setting init_sync and the buffer flags broadcasts at wrap time, and
    whether the buffers follow rank 0 in forward."""
    found: dict[str, Any] = {}
    for label, arguments in {
        "default": {},
        "init_sync=False": {"init_sync": False},
        "broadcast_buffers=False": {"broadcast_buffers": False},
        "forward_sync_buffers=False": {"forward_sync_buffers": False},
    }.items():
        model = _rank_specific_model()
        wrapped = DataParallel(model, cost_model=COST, **arguments)
        params_spread = _spread(_flat(model.parameters()))
        buffers_spread = _spread(_flat(model.buffers()))
        rank_specific = torch.full((2, 4), float(dist.get_rank()))
        wrapped(rank_specific).sum().backward()
        wrapped(rank_specific).sum().backward()
        found[label] = {
            "params": params_spread,
            "buffers": buffers_spread,
            "second_forward_started_from": _spread(model.seen.double()),
        }
    # The agreement check stays with init_sync=False: a model of another shape is refused.
    try:
        DataParallel(nn.Linear(4, 4 + dist.get_rank()), init_sync=False)
    except UsageError as error:
        found["mismatch"] = str(error)
    return found


def _mesh_and_views() -> dict[str, Any]:
    found: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    models = {
        "ddp-mesh": DistributedDataParallel(copy.deepcopy(reference), device_mesh=mesh),
        "ours-mesh": DataParallel(copy.deepcopy(reference), device_mesh=mesh, cost_model=COST),
        "ddp-views": DistributedDataParallel(
            copy.deepcopy(reference), gradient_as_bucket_view=True
        ),
        "ours-views": DataParallel(
            copy.deepcopy(reference),
            gradient_as_bucket_view=True,
            cost_model=COST,
            profile_steps=1,
            tune_steps=0,
            bucketing="single",
        ),
    }
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randn(3, 4, generator=generator) for _ in range(5)]
    for model in models.values():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for batch in batches:
            optimizer.zero_grad(set_to_none=False)
            model(batch).square().sum().backward()
            optimizer.step()
    for name in ("mesh", "views"):
        ours, theirs = models[f"ours-{name}"], models[f"ddp-{name}"]
        found[name] = float((_flat(ours.parameters()) - _flat(theirs.parameters())).abs().max())
    # One bucket: every gradient is a view of the same storage, none owns memory of its own.
    grads = [p.grad for p in models["ours-views"].parameters()]
    found["one_storage"] = (
        len({g.untyped_storage().data_ptr() for g in grads if g is not None}) == 1
    )
    try:
        DataParallel(nn.Linear(2, 2), process_group=dist.group.WORLD, device_mesh=mesh)
    except UsageError as error:
        found["both"] = str(error)
    return found


def _every_case(_: None) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return {"wrap_time": _wrap_time_sync(), **_mesh_and_views()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_every_case, 2, None, timeout=120)


@pytest.mark.parametrize(
    ("label", "params_synced", "buffers_synced", "buffers_follow"),
    [
        ("default", True, True, True),
        ("init_sync=False", False, False, True),
        # DDP 2.13: the deprecated flag keeps buffers out of the wrap-time sync as well ...
        ("broadcast_buffers=False", True, False, False),
        # ... its replacement does not.
        ("forward_sync_buffers=False", True, True, False),
    ],
)
def test_init_sync_and_the_buffer_flags_broadcast_what_ddp_does(
    results: list[dict[str, Any]],
    label: str,
    params_synced: bool,
    buffers_synced: bool,
    buffers_follow: bool,
) -> None:
    for rank_result in results:
        found = rank_result["wrap_time"][label]
        assert (found["params"] == 0.0) is params_synced
        assert (found["buffers"] == 0.0) is buffers_synced
        assert (found["second_forward_started_from"] == 0.0) is buffers_follow


def test_init_sync_false_still_checks_the_ranks_built_one_model(
    results: list[dict[str, Any]],
) -> None:
    for rank_result in results:
        assert "DataParallel's model differs between ranks" in rank_result["wrap_time"]["mismatch"]


def test_a_one_dimensional_device_mesh_averages_over_its_group_like_ddp(
    results: list[dict[str, Any]],
) -> None:
    for rank_result in results:
        assert rank_result["mesh"] < 1e-6
        assert "pass process_group or device_mesh, not both" in rank_result["both"]


def test_gradients_as_bucket_views_train_like_ddp_and_share_the_bucket(
    results: list[dict[str, Any]],
) -> None:
    for rank_result in results:
        assert rank_result["views"] < 1e-6
        assert rank_result["one_storage"]
