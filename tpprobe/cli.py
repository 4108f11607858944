"""The command line: `tpprobe probe | report | diff | layers`.

Exit codes: 0 healthy (rounding noise allowed), 1 findings, 2 bad usage or unreadable input.
Bad usage is one line on stderr (what is wrong, what to do); --debug shows the traceback.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.exceptions import Abort, Exit, TyperException

from .errors import TPProbeError, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="tpprobe: a debugger for tensor-parallel LLM inference.")

_DEBUG = {"on": False}


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"--layers {text!r}: expected comma-separated integers like -1,1,3")


@app.command()
def probe(
    nproc: Annotated[int, typer.Option("--nproc", help="local ranks to start (ignored under torchrun)")] = 2,
    layers: Annotated[str, typer.Option("--layers", help="EAGLE-3 layer ids to capture; -1 = the embedding")] = "-1,1,3",
    num_layers: Annotated[int, typer.Option("--num-layers")] = 6,
    hidden: Annotated[int, typer.Option("--hidden")] = 64,
    heads: Annotated[int, typer.Option("--heads")] = 8,
    ffn: Annotated[int, typer.Option("--ffn")] = 128,
    vocab: Annotated[int, typer.Option("--vocab")] = 131,
    tokens: Annotated[int, typer.Option("--tokens")] = 16,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16")] = "float32",
    backend: Annotated[str, typer.Option("--backend", help="auto (nccl with GPUs, else gloo) | gloo | nccl | sglang")] = "auto",
    arch: Annotated[str, typer.Option("--arch", help="with --backend sglang: llama | deepseek_v2")] = "llama",
    config: Annotated[Optional[str], typer.Option("--config", help="with --backend sglang: a real config.json (random weights)")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="your own model: package.module:factory")] = None,
    inject: Annotated[Optional[list[str]], typer.Option("--inject", help="break the built-in model on purpose (repeatable)")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="capture folder (default: a fresh folder under ./tpprobe-runs)")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds any rank waits on another")] = 60.0,
    exchange: Annotated[str, typer.Option("--exchange", help="full | fingerprint")] = "full",
    json_out: Annotated[bool, typer.Option("--json", help="print report.json instead of the table")] = False,
    html: Annotated[Optional[str], typer.Option("--html", help="also write a self-contained HTML report")] = None,
    markdown: Annotated[Optional[str], typer.Option("--markdown", help="also write a Markdown summary")] = None,
    quiet: Annotated[bool, typer.Option("--quiet")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Probe every TP rank: capture, exchange, check, and print the rank-diff report."""
    from .exchange import dist as tdist
    from .probe import ProbeOptions, run, validate

    _DEBUG["on"] = debug
    opts = ProbeOptions(layers=_ids(layers), num_layers=num_layers, hidden=hidden, heads=heads, ffn=ffn,
                        vocab=vocab, tokens=tokens, seed=seed, dtype=dtype, backend=backend, arch=arch,
                        config=config, model=model, inject=list(inject or []), out=out, timeout=timeout,
                        exchange=exchange, json_out=json_out, html=html, markdown=markdown, quiet=quiet,
                        nproc=nproc, debug=debug)
    if tdist.env_rank() is not None:          # a rank under torchrun / our own launcher
        raise typer.Exit(run(opts))
    validate(opts, nproc)
    if opts.out is None:
        opts.out = time.strftime("tpprobe-runs/%Y%m%d-%H%M%S-") + os.urandom(2).hex()
    from .capture.files import check_out_dir
    check_out_dir(Path(opts.out), 0)
    # one backend decision for every rank, made here and passed on (a rank never decides alone)
    dist_backend = tdist.choose_backend(None if opts.backend in ("auto", "sglang") else opts.backend, nproc)
    gpus = tdist.torch.cuda.device_count() if tdist.torch.cuda.is_available() else 0
    if dist_backend == "gloo" and gpus and not (opts.quiet or opts.json_out):
        print(f"tpprobe: {nproc} ranks on {gpus} GPU(s): every rank runs on gloo (CPU); "
              f"--nproc {gpus} runs NCCL", file=sys.stderr)
    os.environ[tdist.BACKEND_ENV] = dist_backend
    from .launch import launch_local
    raise typer.Exit(launch_local(nproc, ["probe", *options_argv(opts)]))


def options_argv(opts) -> list[str]:
    """ProbeOptions back to the command line the ranks run."""
    a = ["--layers", ",".join(map(str, opts.layers)), "--num-layers", str(opts.num_layers), "--hidden", str(opts.hidden),
         "--heads", str(opts.heads), "--ffn", str(opts.ffn), "--vocab", str(opts.vocab), "--tokens", str(opts.tokens),
         "--seed", str(opts.seed), "--dtype", opts.dtype, "--backend", opts.backend, "--arch", opts.arch,
         "--timeout", str(opts.timeout), "--exchange", opts.exchange, "--out", str(opts.out)]
    for flag, v in (("--config", opts.config), ("--model", opts.model), ("--html", opts.html),
                    ("--markdown", opts.markdown)):
        if v:
            a += [flag, str(v)]
    for f in opts.inject:
        a += ["--inject", f]
    for flag, v in (("--json", opts.json_out), ("--quiet", opts.quiet), ("--debug", opts.debug)):
        if v:
            a.append(flag)
    return a


@app.command()
def report(
    capture_dir: Annotated[Path, typer.Argument(help="a capture folder written by tpprobe probe or the SGLang plugin")],
    json_out: Annotated[bool, typer.Option("--json")] = False,
    html: Annotated[Optional[str], typer.Option("--html")] = None,
    markdown: Annotated[Optional[str], typer.Option("--markdown")] = None,
    quiet: Annotated[bool, typer.Option("--quiet")] = False,
    debug: Annotated[bool, typer.Option("--debug")] = False,
) -> None:
    """Re-run the checks on a capture folder, offline, and print the report."""
    _DEBUG["on"] = debug
    from .tools.offline import report_dir
    raise typer.Exit(report_dir(capture_dir, json_out=json_out, html=html, markdown=markdown, quiet=quiet))


@app.command()
def layers(
    arch: Annotated[str, typer.Option("--arch", help="llama | deepseek_v2 (also deepseek_v3 / kimi)")] = "llama",
    ids: Annotated[Optional[str], typer.Option("--ids", help="EAGLE-3 layer ids, e.g. -1,2,30 (default: SGLang's)")] = None,
    num_layers: Annotated[int, typer.Option("--num-layers")] = 61,
) -> None:
    """What each EAGLE-3 layer id really captures under SGLang's rules (no model is run)."""
    from .tools.layers import parse_ids, render_layers_table
    from .report.terminal import console
    render_layers_table(arch, parse_ids(ids) if ids else None, num_layers, console())


@app.command("diff")
def diff(
    baseline: Annotated[Path, typer.Argument(help="capture folder, SpecForge sample (.ckpt/.pt) or packed tensor file")],
    target: Annotated[Path, typer.Argument(help="the run to check against the baseline (same kinds of input)")],
    rank: Annotated[int, typer.Option("--rank", help="which rank of a capture folder")] = 0,
    all_ranks: Annotated[bool, typer.Option("--all-ranks", help="every rank of the capture folder(s)")] = False,
    slots: Annotated[Optional[int], typer.Option("--slots", help="K: split a bare packed tensor into K slots")] = None,
    hidden: Annotated[Optional[int], typer.Option("--hidden", help="H: split packed tensors into slots of width H")] = None,
    offset: Annotated[Optional[int], typer.Option("--offset", help="target token i = baseline token i+N")] = None,
    threshold: Annotated[Optional[str], typer.Option(
        "--threshold", help="rel diff a slot may have: 1e-3, or per target slot 0=1e-3,2=5e-2 "
                            "(default 1e-5 for float32 pairs, 2e-3 when a side is bf16/fp16)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Compare two runs of the same tokens slot by slot: training dump vs serving capture, tp=1 vs tp=N."""
    from .tools.diff import diff_command    # torch is imported only when a command needs it
    diff_command(baseline, target, rank=rank, all_ranks=all_ranks, slots=slots, hidden=hidden, offset=offset,
                 threshold=threshold, json_out=json_out, debug=debug)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _DEBUG["on"] = "--debug" in argv
    try:
        code = app(args=argv, prog_name="tpprobe", standalone_mode=False)
    except TyperException as e:          # typer's (vendored click) usage errors
        if type(e).__name__ == "NoArgsIsHelpError":
            code = 0
        else:
            ctx = getattr(e, "ctx", None)
            cmd = f"tpprobe {ctx.info_name} --help" if ctx and ctx.info_name != "tpprobe" else "tpprobe --help"
            _fail(f"{e.format_message()} (see {cmd})", e)
            code = 2
    except Exit as e:
        code = e.exit_code
    except Abort:
        code = 130
    except TPProbeError as e:
        _fail(str(e), e)
        code = e.exit_code
    except KeyboardInterrupt:
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


def _fail(msg: str, exc: BaseException) -> None:
    """One line on stderr, never wrapped (scripts grep it); the traceback only with --debug."""
    if _DEBUG["on"]:
        import traceback
        traceback.print_exception(exc)
    line = " ".join(str(msg).split())
    if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        line = f"\x1b[1;31mtpprobe: error: {line}\x1b[0m"
    else:
        line = f"tpprobe: error: {line}"
    print(line, file=sys.stderr, flush=True)
