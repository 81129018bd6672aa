"""The ``xconv`` command line: parse, call the library, print, map errors to exit codes."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

import xconv
from xconv.errors import ConversionError


def _console(stderr: bool = False) -> Console:
    # Built per call so the terminal width (COLUMNS) is read when the command runs.
    return Console(stderr=stderr, highlight=False)


class _Group(click.Group):
    """Turns every ConversionError into a one-line message and its class's exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ConversionError as e:
            first, *rest = str(e).splitlines() or [type(e).__name__]
            err = _console(stderr=True)
            err.print(f"[bold red]error:[/] {first}", markup=True, soft_wrap=True)
            for line in rest:
                err.print(line, markup=False, soft_wrap=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group)
@click.version_option(xconv.__version__, prog_name="xconv")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Translate models between PyTorch, JAX/Flax, TensorFlow and ONNX, with parity proof."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--top", default=0, help="Show only the N most frequent ops (0: all).")
def inspect(model: Path, top: int) -> None:
    """Print opset, inputs/outputs, op histogram, parameters and backend coverage of MODEL."""
    from xconv.inspect import summarize

    _print_summary(summarize(xconv.load(model)), top, title=str(model))


def _print_summary(s, top: int = 0, title: str = "") -> None:
    console = _console()
    console.print(f"[bold]{title}[/]  opset " + ", ".join(f"{d} {v}" for d, v in s.opset.items()))
    io = Table(title="inputs / outputs", show_edge=False)
    for col in ("", "name", "dtype", "shape"):
        io.add_column(col)
    for kind, rows in (("in", s.inputs), ("out", s.outputs)):
        for name, dtype, shape in rows:
            io.add_row(kind, name, dtype, shape)
    console.print(io)
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
    for backend, missing in s.missing_by_backend.items():
        if missing is None:
            console.print(f"backend {backend}: not importable")
        elif not missing:
            console.print(f"backend {backend}: [green]all ops supported[/]")
        else:
            names = ", ".join(f"{m.qualified_name} x{m.count}" for m in missing)
            console.print(f"backend {backend}: [yellow]lacks[/] {names}")


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
    # --template pkg.mod:factory names the user's own code: import it from the working
    # directory, as `python -m` would (a console script's sys.path lacks it).
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    if not input_shape:
        return None
    from xconv.converters.torch.files import example_inputs

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
) -> None:
    """Convert a torch state_dict CHECKPOINT into Flax variables for the generated model.py."""
    from xconv.weights.convert import convert_weights

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
def weights_flax_to_torch(
    variables: Path,
    template: str,
    out: Path,
    input_shape: tuple[str, ...],
    input_dtype: str,
    api: str,
    no_strict: bool,
) -> None:
    """Convert Flax VARIABLES (msgpack, Orbax, safetensors) back into a torch state_dict."""
    from xconv.weights.convert import convert_weights

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
        click.option("--parity", "parity_mode", type=click.Choice(["auto", "whole", "layerwise"]),
                     default="auto", show_default=True,
                     help="float64 oracle over the whole model, or one block at a time "
                          "(per-block report; auto: layerwise for large .pt2 models)."),
        click.option("--input-shape", "input_shapes", multiple=True,
                     help="Example input shape, e.g. 2,3,224,224 (repeat for each input; "
                          "append :int64 for a dtype)."),
        click.option("--dtype", "input_dtypes", multiple=True, default=("float32",),
                     show_default=True, help="Dtype of the example inputs (one, or one each)."),
        click.option("--inputs", "inputs_npz", type=click.Path(dir_okay=False), default=None,
                     help="Example inputs from an .npz file (arrays in input order)."),
        click.option("--dynamic-batch", is_flag=True, help="Symbolic batch dimension."),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


def _cwd_on_path() -> bool:
    return any(p in ("", ".") or Path(p).resolve() == Path.cwd() for p in sys.path if p != "..")


def _run_conversion(source, source_kind: str, target: str, out: Path | None, **kw) -> None:
    from xconv.errors import ParityError
    from xconv.pipeline import ConvertOptions, convert

    options = ConvertOptions(
        api=kw["api"],
        check=not kw["no_check"],
        policy=kw["policy"],
        devices=kw["devices"],
        dynamic_batch=kw["dynamic_batch"],
        module_factory=kw.get("module_factory"),
        trust_pickle=kw.get("trust_pickle", False),
        input_shapes=tuple(kw["input_shapes"]),
        input_dtypes=tuple(kw["input_dtypes"]),
        inputs_npz=kw["inputs_npz"],
        parity=kw.get("parity_mode", "auto"),
    )
    if out is None:
        out = Path(f"{Path(str(source)).stem}_{target}")
    if (kw.get("module_factory") or kw.get("trust_pickle")) and not _cwd_on_path():
        # Factories and pickled modules name modules of the user's working directory.
        sys.path.insert(0, ".")
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
    if result.parity is not None:
        console.print(result.parity)
    if result.timings:
        spent = ", ".join(f"{k} {v:.1f}" for k, v in result.timings.items())
        console.print(f"[dim]seconds: {spent}[/]")
    if result.parity is not None and not result.parity.passed:
        first = result.parity.first_divergence
        raise ParityError(
            "the converted model does not match the source; see "
            f"{result.out_dir / 'parity.html'}" + (f" (first divergence: {first})" if first else "")
        )


#: (source kind, target, what the source argument is)
_COMMANDS = (
    ("torch", "flax", "a PyTorch MODEL (.pt2, TorchScript, or a state_dict with --module)"),
    ("torch", "jax", "a PyTorch MODEL (.pt2, TorchScript, or a state_dict with --module)"),
    ("torch", "onnx", "a PyTorch MODEL (.pt2, TorchScript, or a state_dict with --module)"),
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
    if "." not in sys.path and "" not in sys.path:
        sys.path.insert(0, ".")
    options = CheckpointOptions(
        api=kw["api"],
        parity="none" if kw["no_check"] else "layerwise",
        dynamic_batch=kw["dynamic_batch"],
        input_shapes=tuple(kw["input_shapes"]),
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
    if result.parity is not None:
        console.print(str(result.parity), markup=False, soft_wrap=True)
        if not result.parity.passed:
            raise ParityError(
                "the converted model does not match the source block by block (first "
                f"divergence: {result.parity.first_divergence}); see {result.out_dir}/parity.json"
            )


def _add_conversion_command(source_kind: str, target: str, what: str) -> None:
    def command(model: Path | None, out: Path | None, **kw) -> None:
        if kw.get("weights"):
            if model is not None:
                raise click.UsageError("give either MODEL or --weights, not both")
            _run_checkpoint(target, out, kw)
            return
        if model is None:
            raise click.UsageError("missing argument MODEL (or --module/--config/--weights)")
        for key in ("weights", "config"):
            kw.pop(key, None)
        _run_conversion(model, source_kind, target, out, **kw)

    command.__doc__ = (
        f"Convert {what} to {target}; writes OUT/model.py (where the target has source), "
        "the weights, OUT/model.onnx and OUT/parity.json, and checks parity against the source."
    )
    command = _conversion_options(command)
    if source_kind in ("flax", "jax"):
        command = click.option(
            "--module", "module_factory", required=True,
            help="pkg.mod:factory returning the Flax module (or (module, example_inputs)); "
                 "for jax-to-*, (fn, params[, example_inputs]).",
        )(command)  # fmt: skip
    if source_kind == "torch":
        command = click.option(
            "--module", "module_factory", default=None,
            help="pkg.mod:factory building the module a state_dict loads into (with "
                 "--weights: a class taking the --config, e.g. transformers:LlamaForCausalLM).",
        )(command)  # fmt: skip
        command = click.option(
            "--trust-pickle", is_flag=True,
            help="Allow loading a fully pickled module (runs code from the file).",
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
    # A TensorFlow SavedModel is a folder; every other source is a file.
    path_type = click.Path(dir_okay=source_kind == "tf", exists=source_kind == "tf",
                           path_type=Path)  # fmt: skip
    command = click.argument("model", type=path_type, required=source_kind != "torch")(command)
    main.command(f"{source_kind}-to-{target}")(command)


for _source, _target, _what in _COMMANDS:
    _add_conversion_command(_source, _target, _what)


@main.command()
@click.argument("reference", type=click.Path(path_type=Path))
@click.argument("candidate", type=click.Path(path_type=Path))
@click.option("--policy", type=click.Choice(["oracle", "dtype"]), default="oracle",
              show_default=True)  # fmt: skip
@click.option("--html", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write an HTML report here.")  # fmt: skip
@click.option("--trust-code", is_flag=True,
              help="Allow importing a converted folder's generated model.py.")  # fmt: skip
def check(reference: Path, candidate: Path, policy: str, html: Path | None,
          trust_code: bool) -> None:  # fmt: skip
    """Check that CANDIDATE matches REFERENCE (.onnx files or xconv output folders)."""
    from xconv.errors import ParityError
    from xconv.parity.checker import check_files

    report = check_files(reference, candidate, policy=policy, trust_code=trust_code)
    _console().print(report)
    if html is not None:
        report.to_html(html)
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
    if not result.passed:
        raise ParityError("the demo conversion does not match torch")


if __name__ == "__main__":  # pragma: no cover
    main()
