"""The rounding-noise line (checks/crossrank.py): its worst ULP and relative error are the noise's own, never a
material difference's on another rank of the same point (that one is named by its own finding)."""
from tpprobe.checks.crossrank import rounding_noise


def _s(level, ulp=0.0, rel=0.0):
    return {"level": level, "ulp_max": ulp, "rel_norm": rel}


def test_the_worst_noise_is_taken_from_noise_only():
    # SGLang's DP attention with the embedding's reduce skipped: the packed aux is noise on rank 2 (the other
    # attention-TP group's rounding) and material on ranks 1 and 3 (the partial embedding in slot 0)
    stats = {"layer.0.out": {0: _s("reference"), 1: _s("bitwise"), 2: _s("noise", 2.0, 6.1e-8),
                             3: _s("noise", 2.0, 6.1e-8)},
             "aux.packed": {0: _s("reference"), 1: _s("material", 2443616.25, 0.0267), 2: _s("noise", 24.0, 5.0e-7),
                            3: _s("material", 2443616.25, 0.0267)}}
    (f,) = rounding_noise(["layer.0.out", "aux.packed"], stats, explained=set())
    assert (f.kind, f.where, f.ranks, f.severity) == ("rounding-noise", "layer.0.out, aux.packed", [2, 3], "info")
    assert f.detail == ("2 capture points differ by rounding only (worst element 24.0 ULP, relative error 5e-07, "
                        "within core/noise.py's bounds): not a failure"), f.detail


def test_no_line_without_noise_and_explained_points_left_out():
    stats = {"a": {0: _s("reference"), 1: _s("material", 9e6, 0.5)}, "b": {0: _s("reference"), 1: _s("noise", 3, 1e-7)}}
    assert rounding_noise(["a"], stats, explained=set()) == []
    assert rounding_noise(["a", "b"], stats, explained={"b"}) == []
