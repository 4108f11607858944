"""An --inject fault that acted on no rank gives no verdict (tpprobe/engines/fault_fired.py): the line names it and
where it looked; a fault that acted on one rank only (an @R fault) fired; a rank that did not finish its forward
leaves the verdict to that failure."""
from tpprobe.engines import fault_fired


def _counts(*specs):
    """Counts as one rank records them after applying `specs` [(spec, times it acts)]."""
    fault_fired.reset()
    fires = {}
    for spec, n in specs:
        with fault_fired.injecting(spec):
            if n is not None:
                fires[spec] = (fault_fired.counter(f"where {spec} looks"), n)
    for fire, n in fires.values():
        for _ in range(n):
            fire()
    return fault_fired.counts()


def test_a_fault_that_acts_on_no_rank_is_named_with_where_it_looked():
    ranks = {r: ("ok", _counts(("allreduce-scaled@1", 0), ("rank-weight@1", None))) for r in (0, 1)}
    assert fault_fired.unfired_line(["allreduce-scaled@1", "rank-weight@1"], 2, ranks) == (
        "--inject allreduce-scaled@1 did not fire on any of the 2 ranks: it looks for where allreduce-scaled@1 "
        "looks, and none came: the model ran unbroken, so this run gives no verdict")


def test_one_rank_is_said_as_one():
    ranks = {0: ("ok", _counts(("allreduce-stale@1", 0)))}
    assert fault_fired.unfired_line(["allreduce-stale@1"], 1, ranks) == (
        "--inject allreduce-stale@1 did not fire on its one rank: it looks for where allreduce-stale@1 looks, and "
        "none came: the model ran unbroken, so this run gives no verdict")


def test_faults_that_act_somewhere_or_at_build_fired():
    ranks = {0: ("ok", _counts(("allreduce-rank@1", 0), ("nan@1", None))),
             1: ("ok", _counts(("allreduce-rank@1", 1), ("nan@1", None)))}
    assert fault_fired.unfired_line(["allreduce-rank@1", "nan@1"], 2, ranks) is None


def test_no_line_when_a_rank_failed_or_is_missing_or_nothing_was_injected():
    zero = _counts(("allreduce-scaled@1", 0))
    assert fault_fired.unfired_line(["allreduce-scaled@1"], 2, {0: ("ok", zero), 1: ("error", zero)}) is None
    assert fault_fired.unfired_line(["allreduce-scaled@1"], 2, {0: ("ok", zero)}) is None
    assert fault_fired.unfired_line(["allreduce-scaled@1"], 1, {0: ("ok", None)}) is None     # an older record
    assert fault_fired.unfired_line([], 1, {0: ("ok", zero)}) is None


def test_the_counter_is_a_no_op_outside_a_probe():
    # a live server's plugin applies the same fault code with no probe counting
    fault_fired.reset()
    fault_fired.counter("anywhere")()
    assert fault_fired.counts() == {}
