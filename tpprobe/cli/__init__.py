"""The command line: `tpprobe probe | report | diff | layers | fix | invariance`.

Exit codes: 0 healthy (rounding noise allowed), 1 findings, 2 bad usage or unreadable input,
3 an internal error (a bug in tpprobe: one line naming the rank and step, the traceback with --debug).
Bad usage is one line on stderr (what is wrong, what to do); --debug shows the traceback.
"""
from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from enum import Enum
from typing import Annotated, Optional

import typer
from typer.exceptions import Abort, Exit, TyperException

from ..core.errors import TPProbeError, UsageError
from ..config.knobs import knob_set
from ..invariance.options import HIDDEN as INVARIANCE_HIDDEN, InvarianceOptions
from ..config.options import ProbeOptions, deprecation_line, typer_parameters

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="tpprobe: a debugger for tensor-parallel LLM inference. Exit codes: 0 healthy, 1 findings, 2 "
                       "bad usage, 3 internal error.")

_DEBUG = {"on": False}   # the --debug of the command this process runs: each command sets it when it starts


def _version(value: bool) -> None:
    if value:
        from .. import __version__
        print(f"tpprobe {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print tpprobe's version and exit")] = False) -> None:
    """tpprobe: a debugger for tensor-parallel LLM inference (exit 0 healthy, 1 findings, 2 bad usage)."""


def _shown(default):
    """--help's default: a large float as people write it (2e9, not 2000000000.0)."""
    if isinstance(default, float) and abs(default) >= 1e6:
        return f"{default:.3g}".replace("e+0", "e").replace("e+", "e")
    return True


def _help(text: str, default) -> str:
    shown = _shown(default)
    return text if shown is True else f"{text}  [default: {shown}]"


def _with_options(fn, cls, hidden=frozenset()):
    """Give `fn(**kw)` the typer signature of `cls`'s declared options (tpprobe/config/options.py); the
    options named in `hidden` are left out of --help."""
    params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                annotation=Annotated[t, typer.Option(flag, help=_help(help, default),
                                                                     show_default=_shown(default) is True,
                                                                     hidden=name in hidden)])
              for name, t, default, flag, help in typer_parameters(cls)]
    fn.__signature__ = inspect.Signature(params, return_annotation=None)
    fn.__annotations__ = {**{p.name: p.annotation for p in params}, "return": None}
    return fn


def probe(**kw) -> None:
    """Probe every TP rank: capture, exchange, check, and print the rank-diff report."""
    from ..exchange import dist as tdist
    from ..probe.prepare import options_from_cli, validate
    from ..probe.pipeline import run

    _DEBUG["on"] = bool(kw.get("debug"))
    opts = options_from_cli(**kw)
    rank = tdist.env_rank()
    if (line := deprecation_line(opts.engine_from_backend)) and (rank is None or rank[0] == 0):
        print(line, file=sys.stderr)
    if rank is not None:          # a rank under torchrun / our own launcher
        try:
            code = run(opts)
        except TPProbeError as e:
            if rank[0] != 0:      # every rank meets the same bad setting: rank 0 says it, once
                raise typer.Exit(e.exit_code)
            raise
        raise typer.Exit(code)
    validate(opts, opts.nproc)
    from ..probe.prepare import default_ids_note
    if (note := default_ids_note(opts)) and not opts.json_out:
        print(note, file=sys.stderr)
    if opts.out is None:
        from ..formats.capture_dir import default_out_dir
        opts.out = default_out_dir()
    from ..formats.capture_dir import check_out_dir, remove_if_empty
    existed = Path(opts.out).is_dir()
    check_out_dir(Path(opts.out), 0)
    # one backend decision for every rank, made here and passed on (a rank never decides alone)
    dist_backend = tdist.choose_backend(tdist.named_process_group(opts.backend), opts.nproc)
    gpus = tdist.torch.cuda.device_count() if tdist.torch.cuda.is_available() else 0
    if dist_backend == "gloo" and gpus and not (opts.quiet or opts.json_out):
        where = "its tensors on the GPU (TPPROBE_GLOO_CUDA)" if knob_set(tdist.GLOO_CUDA_ENV) else "CPU"
        print(f"tpprobe: {opts.nproc} ranks on {gpus} GPU(s): every rank runs on gloo ({where}); "
              f"--nproc {gpus} runs NCCL", file=sys.stderr)
    os.environ[tdist.BACKEND_ENV] = dist_backend
    from ..engines.registry import engine_of
    from ..probe.launch import launch_local
    try:
        code = launch_local(opts.nproc, ["probe", *opts.to_argv()], warm=engine_of(opts).preload(opts.arch))
    finally:                     # a launch refused (bad settings) leaves no folder it made behind either
        if not existed:
            remove_if_empty(Path(opts.out))
    raise typer.Exit(code)


app.command("probe")(_with_options(probe, ProbeOptions))


@app.command()
def report(
    capture_dirs: Annotated[list[Path], typer.Argument(
        help="a capture folder written by tpprobe probe or the SGLang or vLLM plugin, or an SGLang dumper folder "
             "(detected by its file names); a watch run's folder (TPPROBE_WATCH), or its per-node folders, merged")],
    json_out: Annotated[bool, typer.Option("--json", help="print report.json instead of the table")] = False,
    emit_dims: Annotated[bool, typer.Option("--emit-dims", help="dumper folders: print the dims each tensor needs in "
                                                                "SGLang's comparator (an --override-config YAML), "
                                                                "from what tpprobe measured")] = False,
    html: Annotated[Optional[str],
                    typer.Option("--html", help="also write a self-contained HTML report to this file")] = None,
    markdown: Annotated[Optional[str], typer.Option("--markdown", help="also write a Markdown summary (for an issue) "
                                                                       "to this file")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="print the verdict lines only")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="show the traceback of an error")] = False,
) -> None:
    """Re-run the checks on a capture folder (or an SGLang dumper folder), offline, and print the report."""
    _DEBUG["on"] = debug
    from .watch_report import main_dirs, watch_report
    if main_dirs(capture_dirs):
        raise typer.Exit(watch_report(capture_dirs, json_out=json_out, quiet=quiet))
    capture_dir = capture_dirs[0]
    from ..formats.sglang_dump import is_dumper_dir, refuse_several_dumps
    refuse_several_dumps(capture_dir)      # the dumper's `dir`, one folder per experiment: which one?
    if is_dumper_dir(capture_dir):
        from ..dumpdir.report import report_command
        for flag, out in (("--html", html), ("--markdown", markdown)):
            if out:
                from ..formats.capture_dir import check_file_path
                check_file_path(Path(out), flag)
        raise typer.Exit(report_command(capture_dir, json_out=json_out, quiet=quiet, emit_dims=emit_dims, html=html,
                                        markdown=markdown))
    if emit_dims:
        raise UsageError(f"--emit-dims reads SGLang dumper folders; {capture_dir} is not one")
    from .report import report_dir
    raise typer.Exit(report_dir(capture_dir, json_out=json_out, html=html, markdown=markdown, quiet=quiet))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "help_option_names": []}, add_help_option=False)
def torchrun(ctx: typer.Context) -> None:
    """Run a probe under torchrun (multi-node too), ending like any tpprobe command.

    torchrun's options, then the command: `tpprobe torchrun --nproc-per-node 4 probe --layers -1,1,3`.
    The same launch as `torchrun ... -m tpprobe probe`, ending like tpprobe: exit 0 healthy, 1 findings,
    2 bad usage, without torchrun's ChildFailedError traceback after a report with findings."""
    if not ctx.args or ctx.args[0] in ("--help", "-h"):
        from ..report.emit import console
        console().print(torchrun.__doc__.replace("\n    ", "\n"))
        raise typer.Exit(0)
    from ..probe.launch import torchrun as run_torchrun
    raise typer.Exit(run_torchrun(list(ctx.args)))


@app.command()
def specforge(
    capture_dir: Annotated[Path, typer.Argument(help="a capture folder written by tpprobe probe (with aux.packed)")],
    out: Annotated[Path, typer.Argument(help="the sample file to write, e.g. rows_0-5000/data_0.ckpt "
                                            "(only its last folder is created)")],
    rank: Annotated[int, typer.Option("--rank", help="whose capture to write (every rank should hold the same)")] = 0,
) -> None:
    """Write a SpecForge EAGLE-3 training sample (data_N.ckpt) from a capture, for `tpprobe diff`."""
    from ..formats.specforge import read_sample, sample_from_capture
    path = sample_from_capture(capture_dir, out, rank)
    aux = read_sample(path)["aux_hidden_state"]
    print(f"wrote {path}: a SpecForge EAGLE-3 sample from rank {rank} of {capture_dir} "
          f"(aux_hidden_state {aux.shape[0]} tokens × {aux.shape[1]})")


def invariance(**kw) -> None:
    """Where bitwise equality across TP sizes and batch sizes breaks, and which collective breaks it."""
    from ..exchange import dist as tdist
    from ..invariance.rank import rank_main
    from ..invariance.run import run as run_inv

    _DEBUG["on"] = bool(kw.get("debug"))
    opts = InvarianceOptions.from_cli(**kw)
    if (line := deprecation_line(opts.engine_from_backend)) and not opts.part:
        print(line, file=sys.stderr)
    if opts.part:
        if tdist.env_rank() is None:
            raise UsageError("--part is the rank side of tpprobe invariance: run tpprobe invariance without it")
        raise typer.Exit(rank_main(opts))
    if tdist.env_rank() is not None:
        raise UsageError("tpprobe invariance starts one group of ranks per TP size itself: run it without torchrun")
    raise typer.Exit(run_inv(opts))


app.command("invariance")(_with_options(invariance, InvarianceOptions, hidden=INVARIANCE_HIDDEN))


@app.command("diff")
def diff(
    baseline: Annotated[Path,
                        typer.Argument(help="capture folder, SpecForge sample (.ckpt/.pt), vLLM extract_hidden_states "
                                            "file (.safetensors) or packed tensor file")],
    target: Annotated[Path, typer.Argument(help="the run to check against the baseline (same kinds of input)")],
    rank: Annotated[int, typer.Option("--rank", help="which rank of a capture folder")] = 0,
    all_ranks: Annotated[bool, typer.Option("--all-ranks", help="every rank of the capture folder(s)")] = False,
    slots: Annotated[Optional[int], typer.Option("--slots", help="K: split a bare packed tensor into K slots")] = None,
    hidden: Annotated[Optional[int],
                      typer.Option("--hidden", help="H: split packed tensors into slots of width H")] = None,
    offset: Annotated[Optional[int], typer.Option("--offset", help="target token i = baseline token i+N")] = None,
    threshold: Annotated[Optional[str], typer.Option(
        "--threshold", help="rel diff² (‖t−b‖²/(‖t‖²+‖b‖²): quadratic: a 1 % difference is 5e-5) a slot may have: "
                            "1e-3, or per target slot 0=1e-3,2=5e-2 "
                            "(default 1e-5 for float32 pairs, 2e-3 when a side is bf16/fp16)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    html: Annotated[Optional[str],
                    typer.Option("--html", help="also write a self-contained HTML report to this file")] = None,
    markdown: Annotated[Optional[str], typer.Option("--markdown", help="also write a Markdown summary (for an issue) "
                                                                       "to this file")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Compare two runs of the same tokens slot by slot: training dump vs serving capture, tp=1 vs tp=N."""
    _DEBUG["on"] = debug
    from .diff import diff_command    # torch is imported only when a command needs it
    diff_command(baseline, target, rank=rank, all_ranks=all_ranks, slots=slots, hidden=hidden, offset=offset,
                 threshold=threshold, json_out=json_out, html=html, markdown=markdown)

@app.command("accept")
def accept(
    draft: Annotated[Path, typer.Option("--draft", help="EAGLE-3 draft checkpoint folder (config.json + safetensors, "
                                                        "as SpecForge writes it)")],
    baseline: Annotated[Path, typer.Option("--baseline", help="aux features the draft should see: capture folder, "
                                                              "SpecForge sample, rank file")],
    target: Annotated[Path, typer.Option("--target",
                                         help="aux features to judge (e.g. the serving capture), same kinds of input")],
    tokens_from: Annotated[Optional[Path],
                           typer.Option("--tokens-from", help="the target's token sequence (default: the target's, "
                                                              "else the baseline's input_ids)")] = None,
    fix: Annotated[bool, typer.Option("--fix", help="also score the target with its slots re-ordered by the slot "
                                                    "matcher")] = False,
    engine: Annotated[str, typer.Option("--engine", help="auto | sglang (SGLang's LlamaForCausalLMEagle3) | torch "
                                                         "(tpprobe's re-implementation)")] = "auto",
    device: Annotated[str,
                      typer.Option("--device",
                                   help="auto (cuda when there is one, else cpu) | cpu | cuda | cuda:N; on cuda the "
                                        "torch engine runs (SGLang's class runs on CPU here)")] = "auto",
    embed: Annotated[Optional[Path],
                     typer.Option("--embed", help="the target's embedding table, when the draft has none")] = None,
    rank: Annotated[int, typer.Option("--rank", help="which rank of a capture folder")] = 0,
    tolerance: Annotated[float, typer.Option("--tolerance",
                                             help="accept-length difference (chain of 5) still called no cost")] = 0.05,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    html: Annotated[Optional[str],
                    typer.Option("--html", help="also write a self-contained HTML report to this file")] = None,
    markdown: Annotated[Optional[str], typer.Option("--markdown", help="also write a Markdown summary (for an issue) "
                                                                       "to this file")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
) -> None:
    """Run the EAGLE-3 draft on both feature sets and say what the target capture costs in accept length."""
    _DEBUG["on"] = debug
    from ..formats.capture_dir import check_file_path
    for flag, out in (("--html", html), ("--markdown", markdown)):
        if out:
            check_file_path(Path(out), flag)
    from ..eagle3.accept.report import accept_report
    from ..eagle3.accept.score import run_accept
    from ..report.emit import Flags, emit
    rep = run_accept(draft, baseline, target, tokens_from=tokens_from, fix=fix, engine=engine,
                     embed=str(embed) if embed else None, rank=rank, tolerance=tolerance, device=device)
    emit(accept_report(rep), None, Flags(json_out=json_out, html=html, markdown=markdown))
    raise typer.Exit(rep["exit_code"])


# `tpprobe layers` (every SGLang architecture, the draft/target contract): typer signature and body
# in cli/layers.py, which imports no torch and no sglang until it runs
from .layers import layers_command  # noqa: E402
app.command("layers")(layers_command)
from .fix import fix_command  # noqa: E402
app.command("fix")(fix_command)


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
            _fail(f"{_choice_message(e, argv) or e.format_message()} (see {cmd})", e)
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
    except Exception as e:                  # a bug in tpprobe itself: one line, its own exit code
        from ..core.errors import INTERNAL_EXIT, say_internal
        say_internal(e, step=_command(argv), debug=_DEBUG["on"])
        code = INTERNAL_EXIT
    sys.exit(code if isinstance(code, int) else 0)


def _command(argv: list[str]) -> Optional[str]:
    """`tpprobe report` for argv ['report', ...] (the step an internal error names)."""
    cmd = next((a for a in argv if not a.startswith("-")), None)
    return f"tpprobe {cmd}" if cmd else None


def _choice_message(e, argv: list[str]) -> Optional[str]:
    """`unknown --backend 'mpi': use auto, gloo or nccl` for a value outside an enum option."""
    param = getattr(e, "param", None)
    enum = getattr(getattr(param, "type_descriptor", None), "annotation", None)   # typer's own option types
    choices = list(enum) if isinstance(enum, type) and issubclass(enum, Enum) else \
        list(getattr(getattr(param, "type", None), "choices", None) or [])
    if not choices:
        return None
    flags = list(getattr(param, "opts", []))
    value = next((a.split("=", 1)[1] for a in argv if "=" in a and a.split("=", 1)[0] in flags), None)
    if value is None:
        value = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in flags), "?")
    names = [str(getattr(c, "value", c)) for c in choices]
    return f"unknown {flags[0] if flags else 'value'} {value!r}: use {', '.join(names[:-1])} or {names[-1]}"


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
