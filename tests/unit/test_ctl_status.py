import io

import pytest

from coordinator import ctl_cluster, serving
from dsv41.v1 import agent_pb2 as apb
from dsv41.v1 import control_pb2 as pb

pytestmark = pytest.mark.unit
NOW = 1_800_000_000.0


def status(phase="serving", reachable=(True, True, False)):
    views = []
    for rank, ok in enumerate(reachable):
        view = pb.NodeView(name=f"spark{rank + 1}", rank=rank, address=f"10.0.0.{rank + 1}", agent_reachable=ok)
        if ok:
            view.status.rank.CopyFrom(apb.RankState(active_state="active", main_pid=1000 + rank,
                                                    active_since_unix_s=NOW - 7380,
                                                    memory_current_bytes=104 << 30))
            view.status.memory.CopyFrom(apb.MemorySample(available_bytes=3 << 30,
                                                          some=apb.Pressure(avg10=12.5)))
            view.fabric.CopyFrom(apb.FabricReport(ok=False, checks=[apb.Check(
                name="rocep1s0f1 port 1", ok=False, detail="state 1: DOWN " + "x" * 100)]))
        else:
            view.agent_error = "UNAVAILABLE: failed to connect to all addresses; last error: " + "y" * 80
        views.append(view)
    return pb.ClusterStatus(phase=phase, endpoint="http://10.0.0.1:8888", ranks_running=2, ranks_total=3,
                            serving_since_unix_s=NOW - 7980, nodes=views, coordinator_running=True,
                            last_incident=pb.Incident(at_unix_s=NOW - 60, node="spark3", kind="rank_exit",
                                                      message="rank on spark3 died first: " + "z" * 100))


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_status_fits_80_columns_and_says_what_matters():
    out = io.StringIO()
    ctl_cluster.render_status(status(), out, now=NOW)
    text = out.getvalue()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "cluster: SERVING  2/3 ranks  up 2h13m  http://10.0.0.1:8888" in text
    assert "spark3   2    down" in text
    assert "last incident 1m00s ago: spark3: rank on spark3 died first" in text
    assert "fabric: rocep1s0f1 port 1: state 1: DOWN" in text
    assert "\033[" not in text  # no colour when not a terminal


def test_colour_only_on_a_terminal():
    out = Tty()
    ctl_cluster.render_status(status(phase="failed"), out, now=NOW)
    assert "\033[31mFAILED\033[0m" in out.getvalue()


def test_progress_line():
    state = apb.PackState(running=True, status_text="layer 14: 41.2/63.0 GiB, 812 MB/s, ETA 27 s", layers=[
        apb.PackLayerState(layer=1, state="complete", total_bytes=100),
        apb.PackLayerState(layer=14, state="packing", done_bytes=50, total_bytes=100)])
    line = ctl_cluster.progress_line("spark2", state)
    assert line.startswith("spark2   [##################......]  75.0% layer 14: 41.2/63.0 GiB")
    assert len(line) < 80


@pytest.mark.parametrize("text, bad", [
    ("", True), ("\ufffd\ufffd", True), ("the the the the the the the the", True), ("!!!! ???? .... ,,,,", True),
    ("The number 7 is prime.", False), ("42", False)])
def test_garbage_detector(text, bad):
    assert (serving.looks_like_garbage(text) is not None) == bad


def test_a_certificate_near_expiry_is_warned_about_weeks_ahead():
    st = status()
    st.nodes[0].status.cert_not_after_unix_s = int(NOW + 10 * 86400)
    st.nodes[1].status.cert_not_after_unix_s = int(NOW + 300 * 86400)
    out = io.StringIO()
    ctl_cluster.render_status(st, out, now=NOW)
    text = out.getvalue()
    assert "spark1: certificate" in text and "dsv41ctl pki rotate --node spark1" in text
    assert "spark2: certificate" not in text


def test_a_rank_its_memory_floor_stopped_says_so_in_its_last_exit():
    st = status()
    floor = st.nodes[1].status.rank
    floor.active_state = "inactive"
    floor.last_exit.CopyFrom(apb.ExitInfo(result="signal", code="killed", status=9, cause=apb.ExitInfo.MEMORY_FLOOR,
                                          cause_detail="available 0.740 GB below MEMORY_FLOOR_GB 0.800 GB"))
    plain = st.nodes[0].status.rank
    plain.active_state = "inactive"
    plain.last_exit.CopyFrom(apb.ExitInfo(result="exit-code", code="exited", status=1))
    out = io.StringIO()
    ctl_cluster.render_status(st, out, now=NOW)
    lines = out.getvalue().splitlines()
    assert any(line.strip() == "last exit: its memory floor stopped it: signal, killed 9" for line in lines), lines
    assert any(line.strip() == "last exit: exit-code, exited 1" for line in lines), lines


def test_fold_breaks_between_words_and_indents_what_follows():
    text = "  last incident 3m02s ago: spark3: spark3 lost: not heard from since 01:29:37 (6.1 s, NODE_LEASE_S=5)"
    lines = ctl_cluster.fold(text, 80, 4)
    assert lines == ["  last incident 3m02s ago: spark3: spark3 lost: not heard from since 01:29:37",
                     "    (6.1 s, NODE_LEASE_S=5)"]
    assert ctl_cluster.fold("short", 80, 4) == ["short"]
    assert ctl_cluster.fold("", 80, 4) == [""]


def test_fold_leaves_room_for_what_precedes_the_first_line_and_cuts_only_a_word_longer_than_a_line():
    lines = ctl_cluster.fold("not answering for 12 s (frozen, powered off or cut off?)", 40, 13, lead=22)
    assert lines == ["not answering for", "             12 s (frozen, powered off", "             or cut off?)"]
    lines = ctl_cluster.fold("x" * 100, 40, 4)
    assert all(len(line) <= 40 for line in lines) and "".join(line.strip() for line in lines) == "x" * 100


def frozen_spark3():
    st = status()
    st.nodes[2].agent_error = "not answering for 12 s (frozen, powered off or cut off?)"
    st.nodes[2].lease_age_s = 12.0
    st.last_incident.CopyFrom(pb.Incident(at_unix_s=NOW - 182, node="spark3", kind="node_lost", message=(
        "spark3 lost: not heard from since 01:29:37 (6.1 s, NODE_LEASE_S=5); then rank exits on spark1 (result "
        "exit-code, exited status 1), spark2 (result exit-code, exited status 1)")))
    return st


def test_status_wraps_long_lines_under_80_columns_without_cutting_a_number():
    out = io.StringIO()
    ctl_cluster.render_status(frozen_spark3(), out, now=NOW)
    text = out.getvalue()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert "spark3   2    down    not answering for 12 s (frozen, powered off or cut off?)" in lines, text
    incident = next(i for i, line in enumerate(lines) if line.startswith("  last incident 3m02s ago"))
    said = " ".join(line.strip() for line in lines[incident:incident + 3])
    assert ("last incident 3m02s ago: spark3: spark3 lost: not heard from since 01:29:37 (6.1 s, NODE_LEASE_S=5); "
            "then rank exits on spark1 (result exit-code, exited status 1), spark2 (result exit-code, exited "
            "status 1)") == said, text
    assert lines[incident + 1].startswith("    ") and lines[incident + 2].startswith("    ")
    assert "fabric: rocep1s0f1 port 1: state 1: DOWN" in text and "x" * 100 in text.replace("\n", "").replace(" ", "")


def test_on_a_terminal_status_uses_its_width():
    out = io.StringIO()
    ctl_cluster.render_status(frozen_spark3(), out, now=NOW, width=250)
    lines = out.getvalue().splitlines()
    assert any(line.startswith("  last incident 3m02s ago: spark3: spark3 lost:") and line.endswith("exited status 1)")
               for line in lines), lines
    assert max(len(line) for line in lines) > 200 and all(len(line) <= 250 for line in lines)


def test_the_terminal_width_is_asked_of_a_terminal_only(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

        def fileno(self):
            return 99

    monkeypatch.setattr(ctl_cluster.os, "get_terminal_size", lambda fd: ctl_cluster.os.terminal_size((132, 40)))
    assert ctl_cluster._width(Terminal()) == 132
    assert ctl_cluster._width(io.StringIO()) == 80


def _gb10(**changes):
    state = apb.GpuState(index=0, name="NVIDIA GB10", uuid="GPU-a", sm_clock_mhz=2418, sm_clock_max_mhz=2418,
                         temperature_c=71, power_w=38.24, utilization_gpu_pct=97, throttle_mask=1,
                         throttle_reasons=["gpu_idle"])
    for key, value in changes.items():
        if isinstance(value, list):
            del getattr(state, key)[:]
            getattr(state, key).extend(value)
        else:
            setattr(state, key, value)
    return state


def test_a_line_per_gpu_under_its_node():
    st = status()
    st.nodes[0].status.gpus.append(_gb10())
    st.nodes[1].status.gpus.append(_gb10(sm_clock_mhz=1203, temperature_c=96, throttle_mask=0x68,
                                         throttle_reasons=["hw_slowdown", "sw_thermal_slowdown",
                                                           "hw_thermal_slowdown"], xid_count=2, last_xid=79))
    out = io.StringIO()
    ctl_cluster.render_status(st, out, now=NOW)
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines), out.getvalue()
    first = lines.index(next(line for line in lines if line.startswith("spark1")))
    assert "             GPU0 NVIDIA GB10: 2418/2418 MHz SM, 71 °C, 38.2 W, 97 % busy" in lines[first + 1:first + 3]
    text = " ".join(line.strip() for line in lines)
    assert ("GPU0 NVIDIA GB10: 1203/2418 MHz SM, 96 °C, 38.2 W, 97 % busy; clocks held by hw_slowdown, "
            "sw_thermal_slowdown, hw_thermal_slowdown; 2 Xid error(s), last Xid 79") in text
    assert "gpu_idle" not in text  # idle is no news


def test_a_figure_the_gpu_does_not_give_is_left_out_and_a_slowdown_is_painted():
    state = apb.GpuState(index=1, name="NVIDIA GB10", sm_clock_mhz=900, throttle_reasons=["hw_thermal_slowdown"])
    assert ctl_cluster.gpu_line(state) == ("GPU1 NVIDIA GB10: 900 MHz SM; clocks held by hw_thermal_slowdown", True)
    assert ctl_cluster.gpu_line(_gb10(throttle_reasons=["sw_power_cap"]))[1] is False
    st = status()
    st.nodes[0].status.gpus.append(state)
    out = Tty()
    ctl_cluster.render_status(st, out, now=NOW, width=100)
    assert "\033[33m             GPU1 NVIDIA GB10: 900 MHz SM" in out.getvalue()


def test_no_gpu_lines_without_gpus():
    out = io.StringIO()
    ctl_cluster.render_status(status(), out, now=NOW)
    assert "GPU" not in out.getvalue()
