"""The emulated network: N ranks on one machine, each in its own network namespace.

Each rank's NIC is a veth into a bridge (the "switch"), shaped to one line rate in both directions
with a token-bucket filter. Needs root and iproute2; docs/notes/launch.md explains the layout.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

from interlace.comm.links import LINK_RATES, default_burst_bytes, parse_link
from interlace.errors import UsageError

__all__ = [
    "MAX_RANKS",
    "NAME_PREFIX",
    "SUBNET",
    "EmulatedCluster",
    "NetemUnavailableError",
    "check_available",
    "cleanup_stale",
    "pid_alive",
    "run_tool",
]

#: Every name this module creates starts with this, then the creating process's PID.
NAME_PREFIX = "ilc"

#: The private /24 the ranks' addresses come from. It exists only inside our own namespaces, which
#: have no route anywhere else, so it cannot clash with (or reach) any network of the host.
SUBNET = "10.213.77"

#: At most this many ranks: hosts .1 to .250 of the /24, and rank numbers of three digits keep
#: interface names within the kernel's 15 characters.
MAX_RANKS = 250

#: The tbf queue limit, as the longest a packet may wait in it: 20 ms of line rate is ample for
#: TCP to keep the link busy at every rate we offer (250 kB at 100 Mbit/s).
TBF_LATENCY = "20ms"

_IFNAMSIZ = 15

#: ``ip netns exec NS`` bind-mounts the files of ``/etc/netns/NS/`` over ``/etc`` for the command;
#: we give each rank a hosts file naming every rank's address, so the reverse look-ups c10d makes
#: of the addresses it connects to answer at once instead of failing (with a warning) through a
#: DNS server that is unreachable from inside the namespace.
NETNS_ETC = "/etc/netns"
_ROOT_HINT = "run as root, or drop --link to run on plain loopback"

# Distinguishes clusters made one after another (or side by side) by the same process, so their
# namespace names never collide; interface names live inside those namespaces and need no such tag.
_sequence = itertools.count()
_sequence_lock = threading.Lock()


class NetemUnavailableError(UsageError):
    """The emulated network cannot be built here; the message says why and what to do."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (a PermissionError still means it exists).

    Args:
        pid: The process ID to look for.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_tool(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command; every command this module runs goes through here.

    Args:
        argv: The command line.
        check: Raise when the command fails.

    Returns:
        The finished process, its output captured as text.

    Raises:
        RuntimeError: When ``check`` and the command exits non-zero, carrying its stderr.
    """
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        detail = proc.stderr.strip() or proc.stdout.strip()
        raise RuntimeError(f"'{' '.join(argv)}' failed (status {proc.returncode}): {detail}")
    return proc


def _list_namespaces() -> list[str]:
    """Names from ``ip netns list`` (which may append `` (id: N)`` to each)."""
    proc = run_tool(["ip", "netns", "list"], check=False)
    if proc.returncode != 0:
        return []
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _kill_namespace_pids(namespace: str) -> None:
    """SIGKILL the processes still inside one of our namespaces.

    Only used on namespaces this module named for a launcher, whose processes are that launcher's
    ranks; a process left inside would keep the namespace (and its veth) alive invisibly after
    ``ip netns del``.
    """
    proc = run_tool(["ip", "netns", "pids", namespace], check=False)
    for token in proc.stdout.split():
        if token.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(token), signal.SIGKILL)


_NS_PATTERN = re.compile(rf"^{NAME_PREFIX}(\d+)c\d+(?:r\d+|sw|probe)$")
_LINK_PATTERN = re.compile(rf"^{NAME_PREFIX}(\d+)[a-z]")


def cleanup_stale() -> list[str]:
    """Remove namespaces and veths left by launchers that are no longer running.

    A launcher killed with SIGKILL gets no chance to clean up; its names embed its PID, so any of
    our names whose PID is not a live process is stale. Names of live PIDs are never touched, so
    two launchers may run side by side. Returns the names removed.
    """
    removed: list[str] = []
    if shutil.which("ip") is None:
        return removed
    for name in _list_namespaces():
        match = _NS_PATTERN.match(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        _kill_namespace_pids(name)
        if run_tool(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    if os.path.isdir(NETNS_ETC):
        for name in os.listdir(NETNS_ETC):
            match = _NS_PATTERN.match(name)
            if match is not None and not pid_alive(int(match.group(1))):
                shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(NETNS_ETC)  # only if now empty
    # Veths are created directly inside our namespaces and die with them; this sweep of the host
    # namespace only catches the unlikely leftovers of a setup killed between two commands.
    links = run_tool(["ip", "-o", "link", "show"], check=False)
    for line in links.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        ifname = parts[1].strip().split("@", 1)[0]
        match = _LINK_PATTERN.match(ifname)
        if match is None or pid_alive(int(match.group(1))):
            continue
        if run_tool(["ip", "link", "del", ifname], check=False).returncode == 0:
            removed.append(ifname)
    return removed


def _probe_namespaces() -> str | None:
    """Try to build a tiny shaped veth in a throwaway namespace; return why it failed, or None."""
    with _sequence_lock:
        tag = next(_sequence)
    namespace = f"{NAME_PREFIX}{os.getpid()}c{tag}probe"
    try:
        tbf = f"root tbf rate 1gbit burst 65536 latency {TBF_LATENCY}"
        steps = [
            ["ip", "netns", "add", namespace],
            ["ip", "-n", namespace, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
            ["tc", "-n", namespace, *f"qdisc add dev p0 {tbf}".split()],
        ]
        for argv in steps:
            proc = run_tool(argv, check=False)
            if proc.returncode != 0:
                detail = proc.stderr.strip() or f"status {proc.returncode}"
                return f"'{' '.join(argv)}' failed: {detail}"
        return None
    finally:
        run_tool(["ip", "netns", "del", namespace], check=False)


def check_available(
    *,
    geteuid: Callable[[], int] | None = None,
    which: Callable[[str], str | None] | None = None,
    probe: bool = True,
) -> None:
    """Raise :class:`NetemUnavailableError` unless an :class:`EmulatedCluster` can be built.

    Checks, in order, that the process is root, that ``ip`` and ``tc`` are on the PATH, and
    (when ``probe``) that a namespace with a tbf-shaped veth can actually be made and removed.

    Args:
        geteuid: Stands in for :func:`os.geteuid`, so a test sees the message of an
            unprivileged machine without being one.
        which: Stands in for :func:`shutil.which`.
        probe: Also build and remove a throwaway shaped namespace.

    Raises:
        NetemUnavailableError: Saying in one line what is missing and what to do.
    """
    euid = (geteuid or os.geteuid)()
    find = which or shutil.which
    if euid != 0:
        raise NetemUnavailableError(
            f"--link needs root to create network namespaces (running as uid {euid}); {_ROOT_HINT}"
        )
    missing = [tool for tool in ("ip", "tc") if find(tool) is None]
    if missing:
        raise NetemUnavailableError(
            f"--link needs iproute2, but {' and '.join(missing)} not found on PATH; install "
            f"iproute2, or drop --link to run on plain loopback"
        )
    if probe:
        why = _probe_namespaces()
        if why is not None:
            raise NetemUnavailableError(
                f"--link cannot create network namespaces here ({why}); {_ROOT_HINT}"
            )


def require(purpose: str) -> None:
    """:func:`check_available`, as the one-line error a command shows.

    Args:
        purpose: What needs the emulated cluster and what to do instead, appended to the
            reason (``"validation measures on the emulated cluster and needs root"``).

    Raises:
        UsageError: Naming why the cluster cannot be built, then ``purpose``.
    """
    try:
        check_available()
    except NetemUnavailableError as exc:
        raise UsageError(f"{exc}; {purpose}") from exc


class EmulatedCluster:
    """``nranks`` network namespaces joined by a bridge, each rank's NIC shaped to ``rate``.

    Use as a context manager (or call :meth:`close`); the constructor cleans up after itself when
    any step of the setup fails. Launch rank ``k``'s command through :meth:`wrap` and give it
    ``GLOO_SOCKET_IFNAME=ifname(k)`` and ``MASTER_ADDR=master_addr``.

    Args:
        nranks: How many ranks (1 to :data:`MAX_RANKS`).
        rate: A :data:`~interlace.comm.links.LINK_RATES` name (or any rate
            :func:`~interlace.comm.links.parse_link` accepts), or bits per second.
        burst_bytes: Overrides the tbf bucket of
            :func:`~interlace.comm.links.default_burst_bytes` (for experiments on the emulation
            itself).

    Raises:
        UsageError: For a rank count or rate out of range.
    """

    def __init__(self, nranks: int, rate: str | float, *, burst_bytes: int | None = None) -> None:
        if not 1 <= nranks <= MAX_RANKS:
            raise UsageError(f"an emulated cluster has 1 to {MAX_RANKS} ranks, got {nranks}")
        self.nranks = nranks
        self.rate_bps = parse_link(rate) if isinstance(rate, str) else float(rate)
        if self.rate_bps <= 0:
            raise UsageError(f"link rate must be > 0 bits/s, got {self.rate_bps}")
        self.burst_bytes = burst_bytes or default_burst_bytes(self.rate_bps)
        if self.burst_bytes < 2048:
            raise UsageError(f"tbf burst must hold a full frame (>= 2048 bytes), got {burst_bytes}")
        pid = os.getpid()
        with _sequence_lock:
            tag = next(_sequence)
        stem = f"{NAME_PREFIX}{pid}"
        self._switch_ns = f"{stem}c{tag}sw"
        self._bridge = f"{stem}br"
        self._rank_ns = [f"{stem}c{tag}r{k}" for k in range(nranks)]
        self._rank_if = [f"{stem}r{k}" for k in range(nranks)]
        self._switch_if = [f"{stem}s{k}" for k in range(nranks)]
        for name in (self._bridge, *self._rank_if, *self._switch_if):
            if len(name) > _IFNAMSIZ:  # only with PIDs beyond 7 digits, which Linux never hands out
                raise RuntimeError(f"interface name {name!r} is longer than {_IFNAMSIZ} chars")
        #: Every namespace created so far, in creation order; :meth:`close` removes them all.
        self.created_namespaces: list[str] = []
        #: The per-namespace ``/etc/netns/<ns>`` folders created so far (hosts files).
        self.created_etc_dirs: list[str] = []
        self._closed = False
        cleanup_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- setup -----------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        run_tool(["ip", "netns", "add", name])
        self.created_namespaces.append(name)

    def _write_hosts(self, rank: int) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        # The machine's own name resolves to the rank's address, as it would on a cluster node.
        lines.append(f"{self.address(rank)} {socket.gethostname()} ilc-rank{rank}")
        lines += [f"{self.address(k)} ilc-rank{k}" for k in range(self.nranks) if k != rank]
        # c10d looks addresses up in their IPv4-mapped IPv6 form; without these lines every
        # connection to the store logs "hostname of the client socket cannot be retrieved".
        lines += [f"::ffff:{self.address(k)} ilc-rank{k}" for k in range(self.nranks)]
        folder = os.path.join(NETNS_ETC, self._rank_ns[rank])
        os.makedirs(folder, exist_ok=True)
        self.created_etc_dirs.append(folder)
        with open(os.path.join(folder, "hosts"), "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")

    def _shape(self, namespace: str, ifname: str) -> None:
        rate = f"{round(self.rate_bps)}bit"
        tbf = f"root tbf rate {rate} burst {self.burst_bytes} latency {TBF_LATENCY}"
        run_tool(["tc", "-n", namespace, "qdisc", "add", "dev", ifname, *tbf.split()])

    def _build(self) -> None:
        sw = self._switch_ns
        self._add_namespace(sw)
        run_tool(["ip", "-n", sw, "link", "add", self._bridge, "type", "bridge"])
        run_tool(["ip", "-n", sw, "link", "set", self._bridge, "up"])
        for k in range(self.nranks):
            ns, rank_if, switch_if = self._rank_ns[k], self._rank_if[k], self._switch_if[k]
            self._add_namespace(ns)
            run_tool(["ip", "-n", ns, "link", "set", "lo", "up"])
            # A cluster fabric keeps its connections warm: Linux would otherwise restart TCP
            # slow start on every connection idle for one RTO, i.e. on every all-reduce that
            # follows a stretch of compute, and small buckets would crawl through slow start.
            run_tool(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "sysctl",
                    "-q",
                    "-w",
                    "net.ipv4.tcp_slow_start_after_idle=0",
                ]
            )
            # Created inside the rank's namespace with its peer placed straight into the switch's,
            # so neither end ever appears in the host's network namespace.
            veth = f"link add {rank_if} type veth peer name {switch_if} netns {sw}"
            run_tool(["ip", "-n", ns, *veth.split()])
            run_tool(["ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", rank_if])
            run_tool(["ip", "-n", ns, "link", "set", rank_if, "up"])
            run_tool(["ip", "-n", sw, "link", "set", switch_if, "master", self._bridge])
            run_tool(["ip", "-n", sw, "link", "set", switch_if, "up"])
            self._shape(ns, rank_if)  # the rank's upload
            self._shape(sw, switch_if)  # the rank's download: the switch port's egress
            self._write_hosts(k)

    # -- what a launcher needs -------------------------------------------------------------

    @property
    def link(self) -> str:
        """The rate as a ``LINK_RATES`` name when it is one, else as ``tc`` bits/s."""
        for name, bps in LINK_RATES.items():
            if bps == self.rate_bps:
                return name
        return f"{round(self.rate_bps)}bit"

    def namespace(self, rank: int) -> str:
        """The network namespace rank ``rank`` runs in.

        Args:
            rank: A rank of this cluster.
        """
        return self._rank_ns[rank]

    def ifname(self, rank: int) -> str:
        """Rank ``rank``'s interface inside its namespace: its ``GLOO_SOCKET_IFNAME``.

        Args:
            rank: A rank of this cluster.
        """
        return self._rank_if[rank]

    def address(self, rank: int) -> str:
        """Rank ``rank``'s IPv4 address (host ``rank + 1`` of the private /24).

        Args:
            rank: A rank of this cluster.

        Raises:
            IndexError: For a rank outside the cluster.
        """
        if not 0 <= rank < self.nranks:
            raise IndexError(f"rank {rank} out of range for {self.nranks} ranks")
        return f"{SUBNET}.{rank + 1}"

    @property
    def master_addr(self) -> str:
        """``MASTER_ADDR`` for every rank: rank 0's address, where the rendezvous store listens."""
        return self.address(0)

    @property
    def switch_namespace(self) -> str:
        """The namespace holding the bridge and the switch-side ends of the veths."""
        return self._switch_ns

    def wrap(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s namespace (``ip netns exec`` then execs it).

        Args:
            rank: The rank whose namespace runs the command.
            argv: The command line.
        """
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every namespace this cluster made (and with them their veths and bridge).

        Idempotent, and tolerant of a setup that stopped half way: it removes exactly what was
        created, ignoring names that are already gone.
        """
        if self._closed:
            return
        # Rank namespaces first: deleting one destroys its veth, and with it the peer in the switch.
        for name in reversed(self.created_namespaces):
            run_tool(["ip", "netns", "del", name], check=False)
        for folder in self.created_etc_dirs:
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(NETNS_ETC)  # only if now empty, i.e. we were its only user
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def __enter__(self) -> EmulatedCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"EmulatedCluster(nranks={self.nranks}, link={self.link!r}, {state})"
