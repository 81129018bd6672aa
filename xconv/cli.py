"""The ``xconv`` command line: parse, call the library, print, map errors to exit codes."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import xconv
from xconv.errors import ConversionError, missing_framework


def _console(stderr: bool = False) -> Console:
    # Built per call so the terminal width (COLUMNS) is read when the command runs.
    return Console(stderr=stderr, highlight=False)


def _warn_downgrades(report) -> None:
    """A ``warning:`` line on stderr for each way the parity proof was weakened (no float64
    oracle, blocks merged, checked whole): the verdict stands, but it is not the oracle's."""
    err = _console(stderr=True)
    for d in getattr(report, "downgrades", None) or ():
        err.print(f"[bold yellow]warning:[/] {escape(d['message'])}", soft_wrap=True)


def _closing(report) -> None:
    """The parity report's closing line (the verdict and any downgrade, in words)."""
    closing = getattr(report, "closing", None)
    if closing is not None:
        style = "green" if report.passed and not report.downgrades else "yellow"
        style = style if report.passed else "bold red"
        _console().print(f"[{style}]{escape(closing)}[/]", soft_wrap=True)


#: Framework loggers silenced below ERROR unless --debug or -v (torch logs a whole traceback
#: for a truncated .pt2 before xconv's own error; TF, absl and JAX print start-up noise).
_FRAMEWORK_LOGGERS = ("torch.export", "torch._export", "torch.fx", "torch.onnx", "absl",
                      "tensorflow", "tf2onnx", "jax", "flax", "orbax", "keras", "h5py")  # fmt: skip


class _Command(click.Command):
    """Records the command and its arguments so an unexpected error can name its files."""

    def invoke(self, ctx: click.Context):
        ctx.meta["xconv.command"] = ctx.command_path
        ctx.meta["xconv.files"] = [
            str(v) for k, v in ctx.params.items() if isinstance(v, Path) and k != "out"
        ] + [str(ctx.params[k]) for k in ("inputs_npz",) if ctx.params.get(k)]
        return super().invoke(ctx)


class _Group(click.Group):
    """Turns every error into a short message and its class's exit code: a ConversionError
    keeps its own, any other exception becomes a one-paragraph error with exit code 10. The
    full traceback is printed only under --debug."""

    command_class = _Command
    group_class = type

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:
            if isinstance(e, ImportError):
                e = missing_framework(e) or e
            if not isinstance(e, ConversionError):
                from xconv.errors import unexpected

                what = ctx.meta.get("xconv.command") or ctx.command_path
                e = unexpected(e, what=what, files=ctx.meta.get("xconv.files", ()))
            err = _console(stderr=True)
            if ctx.meta.get("xconv.debug"):
                import traceback

                cause = e.__cause__ if e.__cause__ is not None else e
                err.print("".join(traceback.format_exception(cause)), markup=False)
            first, *rest = str(e).splitlines() or [type(e).__name__]
            err.print(f"[bold red]error:[/] {escape(first)}", markup=True, soft_wrap=True)
            for line in rest:
                err.print(line, markup=False, soft_wrap=True)
            sys.exit(e.exit_code)


def _rules_option(ctx: click.Context, param: click.Parameter, value: str | None):
    """``--partitioning``: a strategy name, a rules .json file or ``pkg.mod:RULES``, read and
    validated (a ``ShardingError`` exits with its code, like any ConversionError)."""
    if value is None:
        return None
    if ":" in value and not value.lower().endswith(".json"):
        _user_code_importable()  # pkg.mod:RULES names the user's own code
    from xconv.sharding.rules import read_rules

    return read_rules(value)


class _NoTraceback(logging.Filter):
    """Drops the traceback a framework attaches to a log record; the message stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = record.stack_info = None
        return True


@click.group(cls=_Group)
@click.version_option(xconv.__version__, prog_name="xconv")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.option("--debug", is_flag=True, help="Print the full traceback of an error.")
@click.pass_context
def main(ctx: click.Context, verbose: int, debug: bool) -> None:
    """Translate models between PyTorch, JAX/Flax, TensorFlow and ONNX, with parity proof."""
    import os

    ctx.meta["xconv.debug"] = debug
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if debug or verbose:
        return
    # Read when the framework is imported (lazily, inside the command).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TORCH_LOGS", "-all")  # every torch logger at ERROR
    for name in _FRAMEWORK_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _NoTraceback) for f in handler.filters):
            handler.addFilter(_NoTraceback())


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--top", default=0, help="Show only the N most frequent ops (0: all).")
@click.option(
    "--input-shape",
    "input_shapes",
    multiple=True,
    help="Example input shape, for a torch module that records none (repeatable).",
)
@click.option(
    "--input-dtype",
    "input_dtypes",
    multiple=True,
    default=("float32",),
    show_default=True,
    help="Dtype of the example inputs (one, or one each).",
)
@click.option(
    "--module",
    "module_factory",
    default=None,
    help="pkg.mod:factory building the module a state_dict loads into (without it, "
    "a state_dict is summarised as weights).",
)
@click.option(
    "--trust-pickle",
    is_flag=True,
    help="Allow loading a fully pickled module (runs code from the file).",
)
@click.option(
    "--trust-code",
    is_flag=True,
    help="Allow a save_pretrained folder whose config.json names code in the folder.",
)
def inspect(model: Path, top: int, input_shapes: tuple[str, ...], input_dtypes: tuple[str, ...],
            module_factory: str | None, trust_pickle: bool, trust_code: bool) -> None:  # fmt: skip
    """Print opset, inputs/outputs, op histogram, parameters and backend coverage of MODEL.

    MODEL is any file or folder the converters read: .onnx; .pt2, TorchScript, a pickled
    module (--trust-pickle) or a save_pretrained folder; a TensorFlow SavedModel, .keras or
    .pb; or a weights-only file (a torch state_dict, .safetensors, Flax .msgpack, .npz, an
    Orbax folder), summarised as its tensors.
    """
    from xconv.inspect import source_kind

    kind = source_kind(model)  # a missing path or an unknown folder: exit 2, no framework
    if kind == "onnx":
        from xconv.inspect import summarize

        onnx_file = model / "model.onnx" if model.is_dir() else model
        _print_summary(summarize(xconv.load(onnx_file)), top, title=str(model))
        return
    from xconv.inspect import WeightsSummary, read_model, summarize
    from xconv.pipeline import ConvertOptions

    if module_factory:
        _user_code_importable()
    options = ConvertOptions(
        check=False,
        module_factory=module_factory,
        trust_pickle=trust_pickle,
        trust_code=trust_code,
        input_shapes=input_shapes,
        input_dtypes=input_dtypes,
    )
    read = read_model(model, options)
    if isinstance(read, WeightsSummary):
        _print_weights_summary(read, top, title=str(model))
    else:
        _print_summary(summarize(read), top, title=f"{model} ({kind})")


def _print_weights_summary(s, top: int = 0, title: str = "") -> None:
    console = _console()
    console.print(
        f"[bold]{escape(title)}[/]  weights only ({s.format}): {s.tensors} tensors, "
        f"{s.total_params:,} parameters; no graph (give --module to build the model and see "
        "its ops)"
    )
    params = Table(title=f"parameters ({s.total_params:,})", show_edge=False)
    params.add_column("scope")
    params.add_column("count", justify="right")
    for scope, n in s.params_by_scope[: top or None]:
        params.add_row(scope, f"{n:,}")
    console.print(params)
    console.print("dtypes: " + ", ".join(f"{d} x{n}" for d, n in s.dtypes), markup=False)


def _print_summary(s, top: int = 0, title: str = "") -> None:
    console = _console()
    console.print(f"[bold]{title}[/]  opset " + ", ".join(f"{d} {v}" for d, v in s.opset.items()))
    io = Table(title="inputs / outputs", show_edge=False)
    for col in ("", "name", "dtype", "shape"):
        io.add_column(col)
    for kind, rows in (("in", s.inputs), ("out", s.outputs)):
        for name, dtype, shape in rows:
            io.add_row(kind, escape(name), dtype, escape(shape))  # [batch, seq] is no markup
    console.print(io)
    for line in getattr(s, "fixed_dims", ()):
        console.print(f"fixed: {line}", markup=False, soft_wrap=True)
    ops = Table(title=f"ops ({sum(n for _, n in s.op_histogram)} nodes)", show_edge=False)
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, n in s.op_histogram[: top or None]:
        ops.add_row(op, str(n))
    console.print(ops)
    params = Table(title=f"parameters ({s.total_params:,})", show_edge=False)
    params.add_column("scope")
    params.add_column("count", justify="right")
    for scope, n in s.params_by_scope:
        params.add_row(scope, f"{n:,}")
    console.print(params)
    # Per target, every registry the command uses (its runtime and its source templates).
    for target, registries in s.coverage_by_target.items():
        _print_target(console, target, registries)


def _print_target(console, target: str, registries: dict) -> None:
    """One line per conversion target: covered only when every registry it uses covers."""
    labels = ", ".join(registries)
    if any(missing is None for missing in registries.values()):
        absent = ", ".join(label for label, m in registries.items() if m is None)
        console.print(f"target {target}: not installed ({absent})")
    elif not any(registries.values()):
        console.print(f"target {target}: [green]all ops supported[/] ({labels})")
    else:
        parts = [
            f"{label} lacks " + ", ".join(f"{m.qualified_name} x{m.count}" for m in missing)
            for label, missing in registries.items()
            if missing
        ]
        console.print(f"target {target}: [yellow]not covered[/]: " + "; ".join(parts))


@main.group()
def weights() -> None:
    """Convert checkpoints between torch and Flax names and layouts (weights only)."""


_TEMPLATE_HELP = "pkg.mod:factory building the torch module (or (module, inputs))."


def _print_weights_report(report) -> None:
    console = _console()
    console.print(str(report).splitlines()[0], markup=False, soft_wrap=True)
    if report.side_file is not None:
        console.print(f"torch-only state (num_batches_tracked): {report.side_file}", markup=False)


def _template_inputs(input_shape: tuple[str, ...], input_dtype: str):
    _user_code_importable()  # --template pkg.mod:factory names the user's own code
    if not input_shape:
        return None
    from xconv.converters.torch.importer.files import example_inputs

    return example_inputs(list(input_shape), input_dtype)


@weights.command("torch-to-flax")
@click.argument("checkpoint", type=click.Path(exists=True, path_type=Path))
@click.option("--template", required=True, help=_TEMPLATE_HELP)
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None,
              help="Output (default: CKPT's name with the format's suffix).")  # fmt: skip
@click.option("--input-shape", multiple=True, help="Example input shape to trace the template.")
@click.option("--input-dtype", default="float32", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["msgpack", "safetensors", "orbax"]),
              default=None, help="Output format (default: from -o's suffix, else msgpack).")  # fmt: skip
@click.option("--api", type=click.Choice(["linen", "nnx"]), default="linen", show_default=True)
@click.option("--no-strict", is_flag=True, help="Skip bad keys instead of failing.")
@click.option("--trust-pickle", is_flag=True, help="Allow a torch file that needs unpickling.")
@click.option("--mesh", default=None, help="Write an Orbax checkpoint placed on a DATAxMODEL "
              "mesh (e.g. 2x4) shard by shard, by --partitioning.")  # fmt: skip
@click.option("--partitioning", default=None, callback=_rules_option,
              help="Rules for --mesh: fsdp, tp, fsdp+tp (default), a rules .json file or "
              "pkg.mod:RULES.")  # fmt: skip
def weights_torch_to_flax(
    checkpoint: Path,
    template: str,
    out: Path | None,
    input_shape: tuple[str, ...],
    input_dtype: str,
    fmt: str,
    api: str,
    no_strict: bool,
    trust_pickle: bool,
    mesh: str | None,
    partitioning: str | None,
) -> None:
    """Convert a torch state_dict CHECKPOINT into Flax variables for the generated model.py."""
    from xconv.weight_template import convert_weights

    if partitioning is not None and mesh is None:
        raise click.UsageError("--partitioning places the weights on a --mesh (e.g. --mesh 1x1)")
    if mesh is not None:
        fmt = fmt or "orbax"
    if out is None:
        fmt = fmt or "msgpack"
        stem = checkpoint.name.split(".")[0]
        out = checkpoint.with_name(stem + {"msgpack": ".msgpack", "safetensors": ".safetensors",
                                           "orbax": "_orbax"}[fmt])  # fmt: skip
    report = convert_weights(
        checkpoint,
        template,
        direction="torch-to-flax",
        example_inputs=_template_inputs(input_shape, input_dtype),
        out=out,
        format=fmt,
        api=api,
        strict=not no_strict,
        trust_pickle=trust_pickle,
        **({"mesh": mesh, "partitioning": partitioning} if mesh else {}),
    )
    _print_weights_report(report)


@weights.command("flax-to-torch")
@click.argument("variables", type=click.Path(exists=True, path_type=Path))
@click.option("--template", required=True, help=_TEMPLATE_HELP)
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True,
              help="OUT.safetensors or OUT.pt")  # fmt: skip
@click.option("--input-shape", multiple=True, help="Example input shape to trace the template.")
@click.option("--input-dtype", default="float32", show_default=True)
@click.option("--api", type=click.Choice(["linen", "nnx"]), default="linen", show_default=True)
@click.option("--no-strict", is_flag=True, help="Skip bad keys instead of failing.")
@click.option("--train-state", is_flag=True,
              help="VARIABLES is a torch-to-flax --train-state folder: write the torch training "
                   "checkpoint {model, optimizer, scheduler, step} for the --template module.")  # fmt: skip
def weights_flax_to_torch(
    variables: Path,
    template: str,
    out: Path,
    input_shape: tuple[str, ...],
    input_dtype: str,
    api: str,
    no_strict: bool,
    train_state: bool = False,
) -> None:
    """Convert Flax VARIABLES (msgpack, Orbax, safetensors) back into a torch state_dict."""
    from xconv.weight_template import convert_weights

    if train_state:
        from xconv.training.state import write_torch_train_checkpoint

        _template_inputs(input_shape, input_dtype)  # puts the working directory on sys.path
        path = write_torch_train_checkpoint(variables, template, out)
        _console().print(f"[green]wrote[/] {path}", markup=False)
        return

    report = convert_weights(
        variables,
        template,
        direction="flax-to-torch",
        example_inputs=_template_inputs(input_shape, input_dtype),
        out=out,
        api=api,
        strict=not no_strict,
    )
    _print_weights_report(report)


_PRECISION_HELP = (
    "Parity matmul precision: default (each device's own, e.g. TF32 on NVIDIA GPUs, judged "
    "at the precision its dots ran at) or highest (full float32 dots, judged at float32)."
)


def _conversion_options(fn):
    """The options every ``<source>-to-<target>`` command shares."""
    options = [
        click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path),
                     default=None, help="Output folder (default: ./<model name>_<target>)."),
        click.option("--api", type=click.Choice(["linen", "nnx"]), default="linen",
                     show_default=True, help="Flax API of the generated module."),
        click.option("--no-check", is_flag=True, help="Skip the parity check."),
        click.option("--policy", type=click.Choice(["oracle", "dtype"]), default="oracle",
                     show_default=True, help="Parity tolerance policy."),
        click.option("--devices", default="all", show_default=True,
                     help="Devices for the parity check: all, cpu, or a comma list."),
        click.option("--precision", type=click.Choice(["default", "highest"]), default="default",
                     show_default=True, help=_PRECISION_HELP),
        click.option("--parity", "parity_mode", type=click.Choice(["auto", "whole", "layerwise"]),
                     default="auto", show_default=True,
                     help="float64 oracle over the whole model, or one block at a time "
                          "(per-block report; auto: layerwise for large torch models)."),
        click.option("--input-shape", "input_shapes", multiple=True,
                     help="Example input shape, e.g. 2,3,224,224 (repeat for each input; "
                          "append :int64 for a dtype)."),
        click.option("--input-dtype", "input_dtypes", multiple=True, default=("float32",),
                     show_default=True, help="Dtype of the example inputs (one, or one each)."),
        click.option("--dtype", "dtype", default="float32", show_default=True,
                     callback=_compute_dtype,
                     help="Flax / JAX targets: compute dtype, float32 or bfloat16 (float32 "
                          "params; norms and softmax in float32; parity judged by a bfloat16 "
                          "bound written to parity.json)."),
        click.option("--inputs", "inputs_npz", type=click.Path(dir_okay=False), default=None,
                     help="Example inputs from an .npz file (arrays in input order)."),
        click.option("--dynamic-batch", is_flag=True, help="Symbolic batch dimension."),
        click.option("--partitioning", default=None, callback=_rules_option,
                     help="Flax target: logical axes + a rule table in model.py (fsdp, tp, "
                     "fsdp+tp, a rules .json file or pkg.mod:RULES); weights as Orbax; "
                     "load(out_dir, mesh=) shards them."),
        click.option("--mesh", default=None,
                     help="Run the parity check's candidate (flax, jax) sharded over a "
                     "DATAxMODEL mesh of the visible devices, e.g. 2x4."),
        click.option("--format", "weights_format", type=click.Choice(["msgpack", "orbax"]),
                     default=None, help="Flax target: weights file format (default msgpack; "
                     "orbax with --partitioning)."),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


def _compute_dtype(ctx: click.Context, param: click.Parameter, value: str) -> str | None:
    if value == "float32":  # the default: validated without importing the IR (start-up time)
        return None
    from xconv.converters.ops.precision import DTYPES, resolve_dtype
    from xconv.errors import ConversionError

    try:
        return resolve_dtype(value)
    except ConversionError:
        hint = ""
        if value in ("float16", "float64", "int32", "int64", "bool", "uint8"):
            hint = f"; for the example inputs' dtype use --input-dtype {value}"
        raise click.BadParameter(
            f"{value!r} is not a compute dtype; choose one of {', '.join(DTYPES)}{hint}"
        ) from None


def _cwd_on_path() -> bool:
    return any(p in ("", ".") or Path(p).resolve() == Path.cwd() for p in sys.path if p != "..")


def _user_code_importable() -> None:
    """Make ``pkg.mod:name`` arguments (factories, SETUP, rules, pickled classes) importable
    from the working directory, as ``python -m`` would (a console script's sys.path lacks it),
    and see modules written there since the last import scan."""
    import importlib

    if not _cwd_on_path():
        sys.path.insert(0, ".")
    importlib.invalidate_caches()


def _run_conversion(source, source_kind: str, target: str, out: Path | None, **kw) -> None:
    from xconv.errors import ParityError
    from xconv.pipeline import ConvertOptions, convert

    options = ConvertOptions(
        api=kw["api"],
        check=not kw["no_check"],
        policy=kw["policy"],
        devices=kw["devices"],
        dynamic_batch=kw["dynamic_batch"],
        static=kw.get("static", False),
        module_factory=kw.get("module_factory"),
        trust_pickle=kw.get("trust_pickle", False),
        trust_code=kw.get("trust_code", False),
        input_shapes=tuple(kw["input_shapes"]),
        input_dtypes=tuple(kw["input_dtypes"]),
        inputs_npz=kw["inputs_npz"],
        parity=kw.get("parity_mode", "auto"),
        partitioning=kw.get("partitioning"),
        weights_format=kw.get("weights_format"),
        dtype=kw.get("dtype"),
        generate=kw.get("generate", False),
        mesh=kw.get("mesh"),
        precision=kw.get("precision", "default"),
    )
    if out is None:
        out = Path(f"{Path(str(source)).stem}_{target}")
    if kw.get("module_factory") or kw.get("trust_pickle"):
        # Factories and pickled modules name modules of the user's working directory.
        _user_code_importable()
    console = _console()
    with console.status("converting") as status:
        result = convert(
            source,
            source_kind=source_kind,
            target=target,
            out_dir=out,
            options=options,
            progress=lambda msg: status.update(msg + " ..."),
        )
    files = ", ".join(str(p.relative_to(result.out_dir)) for p in result.files)
    console.print(f"[green]wrote[/] {result.out_dir}/: {files}")
    _print_fixed(console, result.model)
    if result.parity is not None:
        console.print(result.parity)
    if result.timings:
        spent = ", ".join(f"{k} {v:.1f}" for k, v in result.timings.items())
        # one line whatever the terminal's width: scripts read it (benchmarks/bench_scale.py)
        console.print(f"[dim]seconds: {spent}[/]", soft_wrap=True)
    if result.parity is not None:
        _warn_downgrades(result.parity)
        _closing(result.parity)
    if result.parity is not None and not result.parity.passed:
        first = result.parity.first_divergence
        raise ParityError(
            "the converted model does not match the source; see "
            f"{result.out_dir / 'parity.html'}" + (f" (first divergence: {first})" if first else "")
        )


def _print_fixed(console: object, model: object) -> None:
    """One line per input dimension the source model fixes (the converted model runs at any
    size of the others)."""
    from xconv.ir.metadata import fixed_summary

    for line in fixed_summary(model):
        console.print(f"fixed: {line}", markup=False, soft_wrap=True)


_TORCH_WHAT = (
    "a PyTorch MODEL (.pt2, TorchScript, a state_dict with --module, or a save_pretrained "
    "folder: config.json + safetensors)"
)
#: (source kind, target, what the source argument is)
_COMMANDS = (
    ("torch", "flax", _TORCH_WHAT),
    ("torch", "jax", _TORCH_WHAT),
    ("torch", "onnx", _TORCH_WHAT),
    ("onnx", "flax", "an ONNX MODEL"),
    ("onnx", "jax", "an ONNX MODEL"),
    ("onnx", "torch", "an ONNX MODEL"),
    (
        "flax",
        "torch",
        "Flax VARIABLES (msgpack, Orbax, safetensors) of the --module factory's model",
    ),
    (
        "flax",
        "onnx",
        "Flax VARIABLES (msgpack, Orbax, safetensors) of the --module factory's model",
    ),
    ("flax", "jax", "Flax VARIABLES (msgpack, Orbax, safetensors) of the --module factory's model"),
    (
        "jax",
        "torch",
        "JAX PARAMS (msgpack, Orbax, safetensors) of the --module factory's (fn, params)",
    ),
    (
        "jax",
        "onnx",
        "JAX PARAMS (msgpack, Orbax, safetensors) of the --module factory's (fn, params)",
    ),
    ("tf", "flax", "a TensorFlow MODEL (SavedModel folder, .keras file or frozen .pb)"),
    ("tf", "torch", "a TensorFlow MODEL (SavedModel folder, .keras file or frozen .pb)"),
    ("tf", "onnx", "a TensorFlow MODEL (SavedModel folder, .keras file or frozen .pb)"),
    ("tf", "jax", "a TensorFlow MODEL (SavedModel folder, .keras file or frozen .pb)"),
)


def _run_checkpoint(target: str, out: Path | None, kw: dict) -> None:
    """``--weights``: a checkpoint larger than memory, traced without weights, streamed."""
    from xconv.checkpoint import CheckpointOptions, convert_checkpoint
    from xconv.errors import ParityError

    if not kw.get("module_factory"):
        raise click.UsageError("--weights needs --module (a class taking the config, or a factory)")
    if kw.get("parity_mode") == "whole":
        raise click.UsageError(
            "--weights checks parity block by block (--parity layerwise, the default there): a "
            "whole-model check would hold the model in memory"
        )
    _user_code_importable()
    options = CheckpointOptions(
        api=kw["api"],
        parity="none" if kw["no_check"] else "layerwise",
        dynamic_batch=kw["dynamic_batch"],
        static=kw.get("static", False),
        input_shapes=tuple(kw["input_shapes"]),
        partitioning=kw.get("partitioning"),
        mesh=kw.get("mesh"),
    )
    out = out or Path(f"{kw['module_factory'].rpartition(':')[2]}_{target}")
    console = _console()
    with console.status("converting") as status:
        result = convert_checkpoint(
            kw["module_factory"],
            kw["weights"],
            target=target,
            out_dir=out,
            config=kw["config"],
            options=options,
            progress=lambda msg: status.update(msg + " ..."),
        )
    console.print(
        f"[green]wrote[/] {result.out_dir}/: {len(result.files)} files, "
        f"{result.stream.bytes_written / 2**30:.2f} GiB of weights streamed"
    )
    for line in result.fixed:
        console.print(f"fixed: {line}", markup=False, soft_wrap=True)
    sharding = result.stream.sharding
    if sharding is not None:
        split = sum(1 for spec in sharding["specs"].values() if any(e for e in spec))
        console.print(
            f"Orbax checkpoint in {len(sharding['parts'])} parts, placed by the rules while "
            f"written (largest part {sharding['largest_part_bytes'] / 2**20:.1f} MiB): "
            f"{split} of {len(sharding['specs'])} variables split; "
            "load(out_dir, mesh=) restores it onto a mesh",
            markup=False,
            soft_wrap=True,
        )
    if result.parity is not None:
        console.print(str(result.parity), markup=False, soft_wrap=True)
        _warn_downgrades(result.parity)
        if not result.parity.passed:
            raise ParityError(
                "the converted model does not match the source block by block (first "
                f"divergence: {result.parity.first_divergence}); see {result.out_dir}/parity.json"
            )


def _train_state_options(fn):
    """``torch-to-flax --train-state``: a training checkpoint to a Flax training state."""
    options = [
        click.option("--train-state", is_flag=True,
                     help="MODEL is a training checkpoint {model, optimizer, scheduler, step}: "
                          "also write train_state/ (Orbax: linen TrainState fields, or nnx "
                          "model + nnx.Optimizer with --api nnx), train_config.json and "
                          "train.py."),
        click.option("--loss", default=None,
                     help="With --train-state: the torch.nn loss (class name or pkg.mod:factory; "
                          "default CrossEntropyLoss)."),
        click.option("--optimizer", default=None,
                     help="With --train-state: the torch.optim class when its state_dict does "
                          "not tell (Adamax, RAdam)."),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


def _run_train_state(model: Path, target: str, out: Path | None, train: dict, kw: dict) -> None:
    from xconv.training.state import convert_train_checkpoint

    if not kw.get("module_factory"):
        raise click.UsageError("--train-state needs --module (the factory of the torch module)")
    out = out or Path(f"{model.stem}_{target}")

    def convert_model(state_dict_file: Path) -> Path:
        _run_conversion(state_dict_file, "torch", target, out, **kw)
        return out

    written = convert_train_checkpoint(
        model, kw["module_factory"], convert_model, loss=train["loss"],
        optimizer=train["optimizer"],
    )  # fmt: skip
    _console().print("[green]wrote[/] " + ", ".join(str(p) for p in written))


def _train_state_back_options(fn):
    """``flax-to-torch --train-state``: a Flax training state back to a torch checkpoint."""
    fn = click.option("--template", default=None,
                      help="With --train-state: pkg.mod:factory of the torch module the training "
                           "checkpoint came from.")(fn)  # fmt: skip
    return click.option("--train-state", is_flag=True,
                        help="MODEL is a torch-to-flax --train-state folder: write the torch "
                             "checkpoint {model, optimizer, scheduler, step} (-o OUT.pt).")(fn)  # fmt: skip


def _run_train_state_back(folder: Path, out: Path | None, template: str | None) -> None:
    from xconv.training.state import write_torch_train_checkpoint

    if not template:
        raise click.UsageError("--train-state needs --template (the torch module's factory)")
    if not folder.is_dir():
        raise click.UsageError(
            f"--train-state needs a torch-to-flax --train-state folder: {folder}"
        )
    _template_inputs((), "float32")  # puts the working directory on sys.path
    path = write_torch_train_checkpoint(folder, template, out or Path(f"{folder.name}_torch.pt"))
    _console().print(f"[green]wrote[/] {path}", markup=False)


def _check_model_path(model: Path, source_kind: str, kw: dict) -> None:
    """Refuse a path of the wrong kind before any framework is imported (a usage error comes
    back in well under a second): a missing path, a folder where a file is read, a torch
    folder that is not a readable save_pretrained folder."""
    from xconv.errors import UsageError

    if not model.exists():
        raise UsageError(f"{model} does not exist; give the path of the model file or folder")
    if not model.is_dir():
        return
    if source_kind == "torch":
        from xconv.converters.torch.importer.hub import read_folder

        read_folder(model, trust_code=kw.get("trust_code", False))
    elif source_kind == "onnx":
        inside = sorted(p.name for p in model.glob("*.onnx"))
        hint = f" (it holds {', '.join(inside[:3])}: give {model / inside[0]})" if inside else ""
        raise UsageError(f"{model} is a folder; give the .onnx file{hint}")


def _add_conversion_command(source_kind: str, target: str, what: str) -> None:
    def command(model: Path | None, out: Path | None, **kw) -> None:
        if kw.get("dtype") and target not in ("flax", "jax"):
            raise click.UsageError(f"--dtype {kw['dtype']}: only flax and jax targets have it")
        if kw.get("dtype") and (kw.get("weights") or kw.get("train_state")):
            raise click.UsageError("--dtype: not with --weights or --train-state")
        if kw.get("generate") and (kw.get("weights") or kw.get("train_state")):
            raise click.UsageError(
                "--generate converts a causal LM from MODEL (a save_pretrained folder or a "
                "module file); not with --weights or --train-state yet"
            )
        if kw.get("weights"):
            if model is not None:
                raise click.UsageError("give either MODEL or --weights, not both")
            _run_checkpoint(target, out, kw)
            return
        if model is None:
            raise click.UsageError("missing argument MODEL (or --module/--config/--weights)")
        for key in ("weights", "config"):
            kw.pop(key, None)
        train = {k: kw.pop(k, None) for k in ("train_state", "loss", "optimizer", "template")}
        if train["train_state"] and source_kind == "flax":
            _run_train_state_back(model, out, train["template"])
            return
        if train["train_state"]:
            _run_train_state(model, target, out, train, kw)
            return
        if source_kind == "flax" and not kw.get("module_factory"):
            raise click.UsageError("missing option --module")
        _check_model_path(model, source_kind, kw)
        _run_conversion(model, source_kind, target, out, **kw)

    command.__doc__ = (
        f"Convert {what} to {target}; writes OUT/model.py (where the target has source), "
        "the weights, OUT/model.onnx and OUT/parity.json, and checks parity against the source."
    )
    command = _conversion_options(command)
    if source_kind in ("flax", "jax"):
        command = click.option(
            "--module", "module_factory", required=(source_kind, target) != ("flax", "torch"),
            help="pkg.mod:factory returning the Flax module (or (module, example_inputs)); "
                 "for jax-to-*, (fn, params[, example_inputs]).",
        )(command)  # fmt: skip
    if source_kind == "torch":
        command = click.option(
            "--static", is_flag=True,
            help="Trace at the example input shapes. By default every input dimension is "
                 "symbolic (named batch, seq, height, width...) unless the model fixes it; "
                 "each fixed one is printed and listed in parity.json.",
        )(command)  # fmt: skip
        command = click.option(
            "--module", "module_factory", default=None,
            help="pkg.mod:factory building the module a state_dict loads into (with "
                 "--weights: a class taking the --config, e.g. transformers:LlamaForCausalLM).",
        )(command)  # fmt: skip
        command = click.option(
            "--trust-pickle", is_flag=True,
            help="Allow loading a pickled module (torch.save(model)) or a TorchScript archive: "
                 "both run code from the file.",
        )(command)  # fmt: skip
        command = click.option(
            "--trust-code", is_flag=True,
            help="Allow a save_pretrained folder whose config.json names code inside the "
                 "folder (auto_map): loading it runs that code.",
        )(command)  # fmt: skip
        if target in ("flax", "jax"):
            command = click.option(
                "--generate", is_flag=True,
                help="A causal LM (a save_pretrained folder or module file): convert it as one "
                     "cached decoding step; model.py gains init_cache, decode and generate, "
                     "and parity.json a generation section (greedy tokens against torch).",
            )(command)  # fmt: skip
        if target in ("flax", "jax", "onnx"):
            command = click.option(
                "--weights", default=None,
                help="A safetensors checkpoint (index .json, folder or 'model-*.safetensors' "
                     "glob) converted without loading it: the --module is traced on fake "
                     "weights and the weights are streamed shard by shard.",
            )(command)  # fmt: skip
            command = click.option(
                "--config", default=None, type=click.Path(exists=True, path_type=Path),
                help="config.json the --module class is built from (with --weights).",
            )(command)  # fmt: skip
    if (source_kind, target) == ("torch", "flax"):
        command = _train_state_options(command)
    if (source_kind, target) == ("flax", "torch"):
        command = _train_state_back_options(command)
    # A TensorFlow SavedModel, a torch save_pretrained folder and a --train-state folder are
    # folders; an ONNX folder is refused by _check_model_path with the file to give instead.
    dir_okay = source_kind in ("tf", "torch", "onnx") or (source_kind, target) == ("flax", "torch")
    path_type = click.Path(dir_okay=dir_okay, exists=source_kind == "tf", path_type=Path)
    command = click.argument("model", type=path_type, required=source_kind != "torch")(command)
    main.command(f"{source_kind}-to-{target}")(command)


for _source, _target, _what in _COMMANDS:
    _add_conversion_command(_source, _target, _what)


@main.command()
@click.argument("reference", type=click.Path(path_type=Path))
@click.argument("candidate", type=click.Path(path_type=Path))
@click.option("--policy", type=click.Choice(["oracle", "dtype"]), default="oracle",
              show_default=True)  # fmt: skip
@click.option("--precision", type=click.Choice(["default", "highest"]), default="default",
              show_default=True, help=_PRECISION_HELP)  # fmt: skip
@click.option("--html", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write an HTML report here.")  # fmt: skip
@click.option("--trust-code", is_flag=True,
              help="Allow importing a converted folder's generated model.py.")  # fmt: skip
@click.option("--devices", default="all", show_default=True,
              help="Devices to run the candidate on: all, cpu, or a comma list.")  # fmt: skip
@click.option("--inputs", "inputs_npz", type=click.Path(dir_okay=False), default=None,
              help="Example inputs from an .npz file (arrays in input order).")  # fmt: skip
@click.option("--random-inputs", default=2, show_default=True, type=click.IntRange(0),
              help="Random input sets drawn within the example inputs' range.")  # fmt: skip
@click.option("--mesh", default=None,
              help="Run the candidate sharded over a DATAxMODEL mesh, e.g. 2x4.")  # fmt: skip
@click.option("--partitioning", "rules", default=None,
              callback=_rules_option,
              help="Parameter sharding for --mesh: fsdp, tp, fsdp+tp, a rules .json file or "
              "pkg.mod:RULES (default fsdp+tp, or as the candidate's load placed them).")  # fmt: skip
def check(reference: Path, candidate: Path, policy: str, precision: str, html: Path | None,
          trust_code: bool, devices: str, inputs_npz: str | None,
          random_inputs: int, mesh: str | None, rules: str | None) -> None:  # fmt: skip
    """Check that CANDIDATE matches REFERENCE (.onnx files or xconv output folders) on the
    example inputs, random draws within their range, and edge inputs (zeros, large)."""
    from xconv.errors import ParityError
    from xconv.parity.checker import check_files, read_inputs_npz

    report = check_files(
        reference,
        candidate,
        None if inputs_npz is None else read_inputs_npz(inputs_npz),
        policy=policy,
        precision=precision,
        trust_code=trust_code,
        devices=[d for d in devices.split(",") if d.strip()] if "," in devices else devices,
        n_random=random_inputs,
        **({"mesh": mesh, "rules": rules} if mesh else {}),
    )
    _console().print(report)
    if html is not None:
        report.to_html(html)
    _warn_downgrades(report)
    _closing(report)
    if not report.passed:
        first = report.first_divergence
        raise ParityError(
            "the candidate does not match the reference"
            + (f" (first divergence: {first})" if first else "")
        )


@main.command()
@click.option(
    "-o",
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the demo's outputs (default: a temporary folder).",
)
def demo(out: Path | None) -> None:
    """Convert a bundled PyTorch CNN to Flax and print the parity summary."""
    import tempfile

    from xconv.demo import build_demo_torch
    from xconv.errors import ParityError
    from xconv.pipeline import ConvertOptions, convert

    console = _console()
    module, inputs = build_demo_torch()
    console.print("[bold]xconv demo[/]: a small ResNet-style PyTorch CNN -> Flax (linen)")
    with tempfile.TemporaryDirectory() as tmp:
        target = out or Path(tmp) / "demo_flax"
        with console.status("converting") as status:
            result = convert(
                module,
                source_kind="torch",
                target="flax",
                out_dir=target,
                options=ConvertOptions(),
                example_inputs=inputs,
                progress=lambda msg: status.update(msg + " ..."),
            )
        console.print(
            f"[green]wrote[/] {result.out_dir}/: " + ", ".join(p.name for p in result.files)
        )
        source = (result.out_dir / "model.py").read_text().splitlines()
        start = next((i for i, line in enumerate(source) if line.startswith("class Model")), 0)
        console.print(f"model.py ({len(source)} lines), from line {start + 1}:")
        console.print("\n".join(source[start : start + 30]), markup=False, soft_wrap=True)
        console.print(result.parity)
        _warn_downgrades(result.parity)
        _closing(result.parity)
    if not result.passed:
        raise ParityError("the demo conversion does not match torch")


@main.command("train-check")
@click.argument("setup")
@click.argument("candidate", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--steps", type=int, default=None, help="Optimizer steps (default: one per batch).")
@click.option("--tol", type=float, default=1e-4, show_default=True,
              help="Largest relative loss difference at any step.")  # fmt: skip
@click.option("--state-tol", type=float, default=None,
              help="Judge parameters and optimizer state against torch's float32 run at this "
                   "relative difference per tensor, instead of element by element against "
                   "its float64 run (the default).")  # fmt: skip
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write the report as JSON here.")  # fmt: skip
@click.option("--html", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the report (with the loss curves) as HTML here.")  # fmt: skip
@click.option("--trust-code", is_flag=True,
              help="Allow importing the candidate folder's generated model.py.")  # fmt: skip
def train_check(setup: str, candidate: Path, steps: int | None, tol: float,
                state_tol: float | None,
                json_out: Path | None, html: Path | None, trust_code: bool) -> None:  # fmt: skip
    """Train SETUP's torch module and the CANDIDATE torch-to-flax folder side by side.

    SETUP is 'pkg.mod:function' (or 'file.py:function') returning a dict with "module",
    "optimizer", "loss_fn", "batches" ((inputs, target) pairs) and optionally "scheduler",
    "clip_grad_norm", "clip_grad_value", "channel_axis".
    """
    from xconv.errors import ParityError
    from xconv.factories import resolve_factory
    from xconv.training.check import check_training

    if not trust_code:
        raise click.UsageError(
            f"checking {candidate} imports its generated model.py; pass --trust-code"
        )
    _user_code_importable()  # SETUP names the user's own code, as --module does
    spec = resolve_factory(setup)()
    missing = [k for k in ("module", "optimizer", "loss_fn", "batches") if k not in spec]
    if missing:
        raise click.UsageError(f"{setup} returned no {', '.join(missing)}")
    extra = {k: spec[k] for k in ("scheduler", "clip_grad_norm", "clip_grad_value",
                                  "channel_axis") if k in spec}  # fmt: skip
    report = check_training(spec["module"], spec["optimizer"], spec["loss_fn"], candidate,
                            spec["batches"], steps=steps, tol=tol, state_tol=state_tol,
                            **extra)  # fmt: skip
    console = _console()
    console.print(
        f"{report.steps} steps: max loss relative difference {report.max_loss_rel_diff():.2e} "
        f"(first 20: {report.max_loss_rel_diff(20):.2e}); parameters after the last step "
        f"{report.param_drift[-1]:.2e}"
    )
    console.print(f"  tensors: {report.policy}", markup=False)
    for note in report.notes:
        console.print(f"  {note}", markup=False)
    if json_out is not None:
        json_out.write_text(report.to_json())
    if html is not None:
        html.write_text(report.to_html())
    if not report.passed:
        raise ParityError(f"training runs part: {report.first_divergence}")
    console.print("[green]passed[/]")


if __name__ == "__main__":  # pragma: no cover
    main()
