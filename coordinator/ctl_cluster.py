"""dsv41ctl commands that talk to the running cluster: status, start, stop, restart, events, logs, pack,
autotune, share."""

from __future__ import annotations

import os
import textwrap
import time
from typing import TextIO

import grpc

from dsv41.adapterversion import adapter_stale
from dsv41.gpu import SLOWDOWN_REASONS
from dsv41.v1 import agent_pb2 as apb
from dsv41.v1 import control_pb2 as pb
from dsv41.v1 import control_pb2_grpc

from .ctl_pki import expiry_warning
from .sockets import CONTROL_GROUP, CONTROL_SOCKET, STATUS_GROUP, status_socket
from .state import Phase

# The status path imports only what it needs: dsv41ctl's start-up time is most of its latency.

GIB = 1 << 30
WIDTH = 80  # status's lines when stdout is not a terminal
INDENT = 13  # a node's detail lines start under its RANK UNIT column


class ControlUnavailable(Exception):
    pass


class ConfigUnusable(Exception):
    """cluster.env is invalid (the message: its errors); raised where the status is read from the agents,
    so that the path through the coordinator never loads the configuration's modules."""


def _usable(path: str) -> bool:
    return os.path.exists(path) and os.access(path, os.R_OK | os.W_OK)


def _stub(socket_path: str, read_only: bool = False) -> control_pb2_grpc.ControlStub:
    """A stub on the control socket; for a command that only reads, the read-only socket beside
    it when the control socket is not ours to use."""
    path = socket_path
    if read_only and not _usable(socket_path) and _usable(status_socket(socket_path)):
        path = status_socket(socket_path)
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        if read_only:
            raise PermissionError(f"permission denied on {socket_path}: add yourself to the {STATUS_GROUP} group "
                                  f"(read only) or the {CONTROL_GROUP} group (also start and stop): sudo usermod "
                                  f"-aG {STATUS_GROUP} $USER, then log in again")
        raise PermissionError(f"permission denied on {socket_path}: add yourself to the {CONTROL_GROUP} group "
                              f"(sudo usermod -aG {CONTROL_GROUP} $USER, then log in again); members of "
                              f"{STATUS_GROUP} may only read")
    if not os.path.exists(path):
        raise ControlUnavailable(f"{path} does not exist")
    return control_pb2_grpc.ControlStub(grpc.insecure_channel(f"unix:{path}"))


def control_command(handler):
    """The answers every command gives when the control socket cannot be used: 4 no permission, 3 no coordinator."""
    def run(args, out: TextIO, err: TextIO) -> int:
        try:
            return handler(args, out, err)
        except PermissionError as exc:
            print(str(exc), file=err)
            return 4
        except (ControlUnavailable, grpc.RpcError) as exc:
            print(f"cannot reach the coordinator ({exc}): is dsv41-coordinator running? "
                  "(systemctl status dsv41-coordinator)", file=err)
            return 3
        except KeyboardInterrupt:
            return 0
    return run


def add_commands(sub, default_config: str) -> None:
    def common(p, socket=True):
        p.add_argument("--config", default=default_config, help="cluster.env (for asking agents directly)")
        if socket:
            p.add_argument("--socket", default=CONTROL_SOCKET, help="the coordinator's control socket")
    status = sub.add_parser("status", help="the cluster and every node; exit 0 only when serving")
    common(status)
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=_status)
    for name, help_text in (("start", "bring the cluster up"), ("stop", "stop every rank, rank 0 first"),
                            ("restart", "stop, then bring the cluster up")):
        p = sub.add_parser(name, help=help_text)
        common(p)
        p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for serving/stopped")
        if name == "restart":
            p.add_argument("--drain", action="store_true",
                           help="a restart that can wait: rank 0 refuses new requests (503 naming the drain) and "
                                "lets those in flight finish, for up to DRAIN_TIMEOUT_S, before the ranks stop")
        p.set_defaults(handler=_action, action=name)
    events = sub.add_parser("events", help="incidents (rank exits, failed steps, restarts)")
    common(events)
    events.add_argument("--follow", "-f", action="store_true")
    events.add_argument("--last", type=int, default=50)
    events.set_defaults(handler=_events)
    pack = sub.add_parser("pack", help="packed Engram shards on every node; --start runs the pack job where needed")
    common(pack)
    pack.add_argument("--start", action="store_true", help="start the pack job on nodes whose packs are not complete")
    pack.set_defaults(handler=_pack)
    autotune = sub.add_parser("autotune", help="FlashInfer autotune caches")
    autotune_sub = autotune.add_subparsers(dest="autotune_command")
    reset = autotune_sub.add_parser("reset", help="clear the caches on every node (the ranks must be stopped)")
    common(reset)
    reset.set_defaults(handler=_autotune_reset)
    fabric = sub.add_parser("fabric", help="the nodes' fabric")
    fabric_sub = fabric.add_subparsers(dest="fabric_command")
    test = fabric_sub.add_parser("test", help="run the collective bandwidth gate's all-reduce on every node now "
                                 "(the ranks must be stopped) and print each pair's and the group's figures")
    common(test)
    test.set_defaults(handler=_fabric_test)
    share = sub.add_parser("share", help="the head's NFS export of the weights")
    share.set_defaults(handler=_share_usage, share_parser=share)
    share_sub = share.add_subparsers(dest="share_command", metavar="ACTION")
    unexport = share_sub.add_parser("unexport", help="stop exporting the weights; refused while a worker has them "
                                    "mounted or ranks run")
    common(unexport)
    unexport.add_argument("--unmount", action="store_true",
                          help="first unmount the export on the workers (their ranks must be stopped)")
    unexport.add_argument("--force", action="store_true",
                          help="unexport even under mounted workers or running ranks: their mounts go stale")
    unexport.set_defaults(handler=_share_unexport)
    logs = sub.add_parser("logs", help="journal lines of the dsv41 units, fetched from the agents")
    common(logs)
    logs.add_argument("--node")
    logs.add_argument("--lines", "-n", type=int, default=50)
    logs.add_argument("--follow", "-f", action="store_true")
    logs.set_defaults(handler=_logs)


def _colour(out: TextIO):
    tty = hasattr(out, "isatty") and out.isatty() and not os.environ.get("NO_COLOR")

    def paint(text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if tty else text
    return paint


def fetch_status(args) -> pb.ClusterStatus:
    """From the coordinator; when it is not running, from the agents directly."""
    try:
        return _stub(args.socket, read_only=True).GetStatus(pb.ClusterStatusRequest(), timeout=15)
    except (ControlUnavailable, grpc.RpcError):
        pass
    from . import config as config_mod
    from .control import cluster_status, node_views
    from .session import load_tls, make_clients
    from .runtime import Snapshot
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigInvalid as exc:
        raise ConfigUnusable(str(exc)) from exc
    try:
        tls = load_tls(cfg)
    except (OSError, FileNotFoundError):
        tls = None
    clients = make_clients(cfg, tls)
    try:
        views = node_views(cfg, clients, {}, {})
    finally:
        for client in clients.values():
            client.close()
    return cluster_status(cfg, Snapshot(phase=Phase.UNKNOWN, detail="the coordinator is not running"), views, False)


def _age(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds >= 86400:
        return f"{seconds // 86400}d{seconds % 86400 // 3600}h"
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def liveness_line(view: pb.NodeView) -> str:
    """The coordinator's lease on the node and its rank's last forward step."""
    text = f"heard {view.lease_age_s:.1f}s ago"
    if view.step_age_s >= 0:
        text += f", last forward step {_seconds(view.step_age_s)} ago (step {view.forward_count})"
    return text


def _seconds(value: float) -> str:
    return f"{value:.1f}s" if value < 60 else _age(value)


def fold(text: str, width: int, indent: int, lead: int = 0) -> list[str]:
    """`text` in lines of at most `width` columns, broken between words, the lines after the first
    indented by `indent` spaces; `lead`: columns already taken on the first line by what precedes it.
    Only a word longer than a whole line is cut, where the line ends."""
    wrapper = textwrap.TextWrapper(width=max(width, indent + 20), initial_indent=" " * lead,
                                   subsequent_indent=" " * indent, break_long_words=True,
                                   break_on_hyphens=False)
    lines = wrapper.wrap(text) or [" " * lead]
    return [lines[0][lead:]] + lines[1:]


def _width(out: TextIO) -> int:
    """The terminal's width when `out` is one, else WIDTH."""
    try:
        return os.get_terminal_size(out.fileno()).columns if out.isatty() else WIDTH
    except (AttributeError, OSError, ValueError):
        return WIDTH


def stale_adapter_lines(nodes) -> list[str]:
    """One line per node whose running rank loaded other adapter code than is installed now (an
    upgrade re-adopts the ranks without restarting them); none where they match or either is unknown."""
    lines = []
    for view in nodes:
        rank, installed = view.status.rank, view.status.adapter_version
        running = rank.active_state in ("active", "activating", "reloading")
        if view.agent_reachable and running and adapter_stale(rank.adapter_version, installed):
            lines.append(f"{view.name}: rank runs adapter {rank.adapter_version}, {installed} is installed: "
                         "the next restart of the ranks loads it")
    return lines


def gpu_line(gpu: apb.GpuState) -> tuple[str, bool]:
    """`GPU0 NVIDIA GB10: 2418/2418 MHz SM, 71 °C, 38.2 W, 97 % busy`, then its throttle reasons
    other than idle, and its Xid errors; a figure the GPU does not give is left out. The flag: a
    thermal or hardware slowdown or an Xid, worth a colour."""
    parts = []
    if gpu.HasField("sm_clock_mhz"):
        top = f"/{gpu.sm_clock_max_mhz}" if gpu.HasField("sm_clock_max_mhz") else ""
        parts.append(f"{gpu.sm_clock_mhz}{top} MHz SM")
    if gpu.HasField("temperature_c"):
        parts.append(f"{gpu.temperature_c} °C")
    if gpu.HasField("power_w"):
        parts.append(f"{gpu.power_w:.1f} W")
    if gpu.HasField("utilization_gpu_pct"):
        parts.append(f"{gpu.utilization_gpu_pct} % busy")
    text = f"GPU{gpu.index} {gpu.name or '?'}: {', '.join(parts) or 'no figures'}"
    reasons = [r for r in gpu.throttle_reasons if r != "gpu_idle"]
    if reasons:
        text += f"; clocks held by {', '.join(reasons)}"
    if gpu.xid_count:
        text += f"; {gpu.xid_count} Xid error(s), last Xid {gpu.last_xid}"
    return text, bool(set(reasons) & SLOWDOWN_REASONS or gpu.xid_count)


def render_status(st: pb.ClusterStatus, out: TextIO, now: float | None = None, width: int | None = None) -> None:
    paint = _colour(out)
    now = time.time() if now is None else now
    width = _width(out) if width is None else width

    def put(text: str, indent: int = INDENT) -> None:
        for line in fold(text, width, indent):
            print(line, file=out)
    good = st.phase == Phase.SERVING
    phase = paint(st.phase.upper(), "32" if good else ("31" if st.phase in (Phase.FAILED, Phase.UNKNOWN) else "33"))
    head = f"cluster: {phase}"
    if good:
        head += f"  {st.ranks_running}/{st.ranks_total} ranks  up {_age(now - st.serving_since_unix_s)}  {st.endpoint}"
    print(head, file=out)
    if st.phase_detail and not good:
        put(f"  {st.phase_detail}", 4)
    if not st.coordinator_running:
        print(paint("  coordinator: not running (status read from the agents)", "33"), file=out)
    if st.config_note:
        for line in fold(f"  {st.config_note}", width, 4):
            print(paint(line, "33"), file=out)
    if st.restart_attempt:
        print(f"  restart attempt {st.restart_attempt}", file=out)
    if st.last_incident.kind:
        i = st.last_incident
        put(f"  last incident {_age(now - i.at_unix_s)} ago: {i.node}: {i.message}", 4)
    for line, ok in group_lines(st, now):
        for part in fold(line, width, 6):
            print(part if ok else paint(part, "33"), file=out)
    print(f"{'NODE':<9}{'RANK':<5}{'AGENT':<8}{'RANK UNIT':<17}{'UP':<8}{'RSS':>7}{'AVAIL':>8}{'PSI10':>7}  MOUNT",
          file=out)
    for view in st.nodes:
        s = view.status
        if not view.agent_reachable:
            head = f"{view.name:<9}{view.rank:<5}"  # then AGENT, 8 columns, and the error under RANK UNIT
            lines = fold(view.agent_error, width, INDENT, lead=len(head) + 8)
            print(f"{head}{paint('down', '31')}    {lines[0]}", file=out)
            for line in lines[1:]:
                print(line, file=out)
            if st.coordinator_running and view.lease_age_s >= 0:
                put(f"{'':<13}{liveness_line(view)}")
            continue
        rank = s.rank
        unit = rank.active_state + (f" {rank.main_pid}" if rank.main_pid else "")
        up = _age(now - rank.active_since_unix_s) if rank.active_state == "active" and rank.active_since_unix_s else "-"
        rss = f"{rank.memory_current_bytes / GIB:.1f}G" if rank.memory_current_bytes else "-"
        avail = f"{s.memory.available_bytes / GIB:.1f}G"
        mount = apb.MountState.State.Name(s.mount.state).lower() if s.mount.state else "-"
        print(f"{view.name:<9}{view.rank:<5}{'up':<8}{unit:<17}{up:<8}{rss:>7}{avail:>8}"
              f"{s.memory.some.avg10:>6.1f}%  {mount}", file=out)
        if st.coordinator_running and view.lease_age_s >= 0:
            put(f"{'':<13}{liveness_line(view)}")
        expiry = expiry_warning(view.name, s.cert_not_after_unix_s, now)
        if expiry:
            print(paint(f"{'':<13}{expiry}", "33"), file=out)
        if rank.last_exit.result and rank.active_state != "active":
            e = rank.last_exit
            # A floor stop is found here even when no coordinator ran to record it as an incident.
            why = ": its memory floor stopped it" if e.cause == apb.ExitInfo.MEMORY_FLOOR else ""
            put(f"{'':<13}last exit{why}: {e.result}, {e.code} {e.status}")
        for gpu in s.gpus:
            text, warn = gpu_line(gpu)
            for line in fold(f"{'':<{INDENT}}{text}", width, INDENT + 2):
                print(paint(line, "33") if warn else line, file=out)
        failed = [c for c in view.fabric.checks if not c.ok]
        for check in failed[:3]:
            put(f"{'':<13}fabric: {check.name}: {check.detail}")
    for line in stale_adapter_lines(st.nodes):
        first, *rest = fold(line, width, 4, lead=2)
        for part in ["  " + first, *rest]:
            print(paint(part, "33"), file=out)
    if st.HasField("collective"):
        text, ok = collective_line(st.collective)
        for part in fold(text, width, 4):
            print(part if ok else paint(part, "31"), file=out)


def group_lines(st: pb.ClusterStatus, now: float) -> list[tuple[str, bool]]:
    """With GROUPS: the gateway (where clients connect, its workers) and a line per group."""
    if not st.groups:
        return []
    gw = st.gateway
    workers = ", ".join(f"{w.group or '?'} {w.url} {'healthy' if w.healthy else 'unhealthy'}" for w in gw.workers)
    lines = [(f"  gateway {gw.url}: unit {gw.unit_state or 'unknown'}, {'ready' if gw.ready else 'not ready'}; "
              f"workers: {workers or 'none'}" + (f"; {gw.error}" if gw.error else ""), gw.ready and not gw.error)]
    for g in st.groups:
        serving = g.phase == Phase.SERVING
        what = f"up {_age(now - g.serving_since_unix_s)}" if serving else g.phase_detail
        lines.append((f"  group {g.name} ({', '.join(g.nodes)}): {g.phase} {g.endpoint}" + (f"  {what}" if what else ""),
                      serving))
    return lines


def collective_line(report) -> tuple[str, bool]:
    """The collective gate's last run, one line: its figures, the transport and the floors."""
    transports = ",".join(sorted(set(report.transports.values()) - {""}))
    via = f" via {transports}" if transports else ""
    figures = ", ".join(f"{f.group} {f.busbw_gbps:.2f} GB/s" for f in report.figures)
    verdict = "passed" if report.ok else f"FAILED: {report.reason}"
    return (f"collective gate ({report.backend}{via}): {figures} (floors {report.pair_floor_gbps:g} per pair, "
            f"{report.group_floor_gbps:g} GB/s the group); {verdict}"), report.ok


def _status(args, out: TextIO, err: TextIO) -> int:
    try:
        st = fetch_status(args)
    except PermissionError as exc:
        print(str(exc), file=err)
        return 4
    except ConfigUnusable as exc:
        print(f"coordinator not running, and {args.config} is invalid:\n{exc}", file=err)
        return 3
    if args.json:
        import json

        from google.protobuf import json_format
        body = json_format.MessageToDict(st, preserving_proto_field_name=True, including_default_value_fields=True)
        json.dump(body, out, indent=2, sort_keys=True)
        out.write("\n")
    else:
        render_status(st, out)
    return 0 if st.phase == Phase.SERVING else 1


@control_command
def _action(args, out: TextIO, err: TextIO) -> int:
    stub = _stub(args.socket)
    method = {"start": stub.Start, "stop": stub.Stop, "restart": stub.Restart}[args.action]
    request = {"start": pb.StartRequest, "stop": pb.StopRequest, "restart": pb.RestartRequest}[args.action]()
    if getattr(args, "drain", False):
        request.drain = True
    reply = method(request, timeout=30)
    print(reply.message, file=out)
    want = Phase.STOPPED if args.action == "stop" else Phase.SERVING
    end = time.monotonic() + args.wait
    status = reply.status
    while args.wait and time.monotonic() < end:
        status = stub.GetStatus(pb.ClusterStatusRequest(), timeout=15)
        if status.phase == want or status.phase == Phase.FAILED:
            break
        time.sleep(0.5)
    if args.wait:
        render_status(status, out)
        return 0 if status.phase == want else 1
    return 0


@control_command
def config_call(args, out: TextIO, err: TextIO) -> int:
    """dsv41ctl config diff|apply|rollback: 0 done (or nothing to do), 1 refused (the reason on stderr)."""
    action = {"diff": pb.ConfigRequest.DIFF, "apply": pb.ConfigRequest.APPLY,
              "rollback": pb.ConfigRequest.ROLLBACK}[args.config_action]
    reply = _stub(args.socket).Config(pb.ConfigRequest(action=action), timeout=120)
    print(reply.message, file=out if reply.ok else err)
    return 0 if reply.ok else 1


@control_command
def _events(args, out: TextIO, err: TextIO) -> int:
    for event in _stub(args.socket, read_only=True).Events(pb.EventsRequest(follow=args.follow, last=args.last)):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.at_unix_s))
        print(f"{when} {event.node} {event.kind}: {event.message}", file=out, flush=True)
    return 0


@control_command
def _logs(args, out: TextIO, err: TextIO) -> int:
    request = pb.LogsRequest(node=args.node or "", lines=args.lines, follow=args.follow)
    for line in _stub(args.socket, read_only=True).Logs(request):
        when = time.strftime("%H:%M:%S", time.localtime(line.at_unix_s))
        print(f"{when} {line.node} {line.unit}: {line.message}", file=out, flush=True)
    return 0


def progress_line(node: str, state: apb.PackState, width: int = 24) -> str:
    total = sum(layer.total_bytes for layer in state.layers)
    from .packstate import incomplete as pack_incomplete, layer_state
    done = sum(layer.done_bytes if layer_state(layer) != apb.PackLayerState.COMPLETE else layer.total_bytes
               for layer in state.layers)
    fraction = done / total if total else (0.0 if pack_incomplete(state) else 1.0)
    bar = "#" * int(fraction * width) + "." * (width - int(fraction * width))
    states = ",".join(sorted({layer.state for layer in state.layers})) or "-"
    text = state.status_text if state.running else states
    return f"{node:<8} [{bar}] {fraction * 100:5.1f}% {text}"[:79]


@control_command
def _pack(args, out: TextIO, err: TextIO) -> int:
    last: dict[str, apb.PackState] = {}
    tty = hasattr(out, "isatty") and out.isatty()
    for progress in _stub(args.socket, read_only=not args.start).Pack(pb.PackRequest(start=args.start)):
        last[progress.node] = progress.state
        if tty:
            out.write("\x1b[%dA" % (len(last) - 1) if len(last) > 1 else "")
            out.write("\r" + "\n".join(progress_line(n, s) for n, s in last.items()) + "\x1b[K")
            out.flush()
        elif progress.done:
            print(progress_line(progress.node, progress.state), file=out, flush=True)
    if tty:
        out.write("\n")
    from .packstate import incomplete as pack_incomplete
    incomplete = [n for n, s in last.items() if pack_incomplete(s)]
    if incomplete:
        print(f"not complete on: {', '.join(incomplete)}", file=err)
        return 1
    return 0


@control_command
def _autotune_reset(args, out: TextIO, err: TextIO) -> int:
    reply = _stub(args.socket).AutotuneReset(pb.AutotuneResetRequest(), timeout=120)
    print(reply.message, file=out if reply.ok else err)
    return 0 if reply.ok else 1


@control_command
def _fabric_test(args, out: TextIO, err: TextIO) -> int:
    reply = _stub(args.socket).FabricTest(pb.FabricTestRequest(), timeout=700)
    if reply.HasField("report") and reply.report.figures:
        print(collective_line(reply.report)[0], file=out)
    print(reply.message, file=out if reply.ok else err)
    return 0 if reply.ok else 1


def _share_usage(args, out: TextIO, err: TextIO) -> int:
    args.share_parser.print_usage(err)
    print("dsv41ctl share: error: name an action: unexport", file=err)
    return 2


@control_command
def _share_unexport(args, out: TextIO, err: TextIO) -> int:
    request = pb.UnexportRequest(force=args.force, unmount=args.unmount)
    reply = _stub(args.socket).UnexportShare(request, timeout=200)
    print(reply.message, file=out if reply.ok else err)
    return 0 if reply.ok else 1
