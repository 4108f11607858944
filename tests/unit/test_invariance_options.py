"""`tpprobe invariance`'s options are declared once (tpprobe/invariance/options.py): the command's
typer signature and the argv its ranks run are derived from that declaration, so what the parent
hands a TP size's ranks parses back, through the real command line, to the same options."""
from __future__ import annotations

import dataclasses

import typer

from tpprobe.cli import app
from tpprobe.invariance.options import HIDDEN, InvarianceOptions


def _parse(argv: list[str]) -> InvarianceOptions:
    cmd = typer.main.get_command(app).commands["invariance"]
    ctx = cmd.make_context("invariance", list(argv))
    return InvarianceOptions.from_cli(**ctx.params)


def test_the_ranks_argv_parses_back_to_the_parents_options():
    parent = _parse(["--tp", "4,1,2", "--batch", "3,1", "--reference", "tp2,b3", "--expect", "noise",
                     "--reduce", "ordered", "--switch-above", "8192", "--num-layers", "3", "--hidden", "32",
                     "--heads", "4", "--ffn", "64", "--vocab", "97", "--tokens", "9", "--seed", "5",
                     "--dtype", "bfloat16", "--keep", "--timeout", "12.5", "--json", "--html", "r.html",
                     "--debug", "--out", "parent"])
    assert (parent.tp, parent.batch, parent.reference, parent.switch_above) == ([1, 2, 4], [1, 3], (2, 3), 8192)
    parent.sites = ["layers.0.self_attn.o_proj", "layers.0.mlp.down_proj"]    # what the largest TP size issued
    argv = parent.to_argv(2, "parent/tp2")
    assert argv[0] == "invariance" and "--part" in argv and "--quiet" in argv
    rank = _parse(argv[1:])
    # the rank side: one TP size, its own folder, quiet; the comparison and the report stay with the parent
    want = dataclasses.replace(parent, tp=[2], out="parent/tp2", part=True, quiet=True, reference=None,
                               expect="bitwise", json_out=False, html=None, probe=None)
    assert rank == want
    assert rank.probe.dtype == "bfloat16" and rank.probe.hidden == 32 and rank.probe.exchange == "fingerprint"


def test_the_rank_side_flags_are_declared_but_hidden_from_help():
    cmd = typer.main.get_command(app).commands["invariance"]
    hidden = {p.name for p in cmd.params if getattr(p, "hidden", False)}
    assert hidden == set(HIDDEN) == {"part", "sites"}
    declared = [f.metadata["flag"] for f in dataclasses.fields(InvarianceOptions) if "flag" in f.metadata]
    assert [o for p in cmd.params for o in p.opts] == declared and len(declared) == 29
