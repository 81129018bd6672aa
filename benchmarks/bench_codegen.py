"""How the generated Flax source reads: writes ``docs/codegen.md``.

For each torch fixture (and, with ``--hf``, tiny transformers models built from configs): lines
of the generated linen ``model.py`` beside the hand-written source's (the fixture's classes;
transformers' own modeling classes on the forward path), generated classes vs distinct source
module classes, locals still carrying an exporter name (``getitem_3``, ``conv2d_1``; target
0), the longest line, and parity (max abs difference against torch). The ``before`` columns are the flat
emitter (``FlaxOptions(share_blocks=False)``), measured in the same run. A second table: the
PyTorch source ``xconv.to_torch_source`` writes for Flax sources (a BERT-shaped fixture, the
CNN fixture, a ResNet-shaped fixture, flaxmodels' ResNet-18), beside the Flax classes' own length.

Run: ``python benchmarks/bench_codegen.py [--hf] [--write]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _doc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "codegen.md"
ROLE_NAMES = {"x", "h", "residual", "q", "k", "v", "scores", "attn", "mask", "shape", "_"}


def _exporter_names(src: str, model) -> int:
    """Assigned locals named after an exporter value or an op type (not a role name)."""
    values = {v.name for n in model.graph for v in n.outputs if v.name}
    ops = {re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", n.op_type).lower() for n in model.graph}
    inputs = {v.name for v in model.graph.inputs}
    count = 0
    for line in src.splitlines():
        m = re.match(r"\s+([\w, ]+?) = ", line)
        if not m or line.lstrip().startswith("self."):
            continue
        for name in (t.strip() for t in m.group(1).split(",")):
            base = re.sub(r"_\d+$", "", name)
            if name in ROLE_NAMES or name in inputs or base in ROLE_NAMES:
                continue
            if name in values or base in ops or base in values:
                count += 1
    return count


def _classes(src: str) -> int:
    return len(re.findall(r"^class \w+\((?:nn|nnx)\.Module\)", src, flags=re.M))


def _source_classes(module) -> int:
    return len({type(m) for m in module.modules() if list(m.children())})


def _sloc(src: str) -> int:
    """Non-blank lines that are neither comments nor docstrings."""
    import ast
    import textwrap

    src = textwrap.dedent(src)
    docs: set[int] = set()
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, scopes) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for i, line in enumerate(src.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#") and i not in docs
    )


def _class_lines(classes) -> int | None:
    import inspect

    return sum(_sloc(inspect.getsource(c)) for c in classes) or None


def _reference_lines(module) -> int | None:
    """Code lines of the hand-written source classes (the fixtures' own torch modules)."""
    return _class_lines(
        {type(m) for m in module.modules() if type(m).__module__.startswith("fixtures.")}
    )


def _hf_reference_lines(module, inputs) -> int | None:
    """Code lines of transformers' own hand-written torch source on the forward path: each
    distinct module class of the model's modeling file whose ``forward`` the run calls (the
    whole class, as for the fixtures), plus that file's module-level functions the run calls
    (``apply_rotary_pos_emb``, ``eager_attention_forward``). Library layers (``torch.nn``,
    ``transformers.activations``, ``transformers.pytorch_utils.Conv1D``) and the attention
    kernels outside the modeling file are not counted, as ``torch.nn`` is not for the fixtures.
    """
    import inspect

    import torch

    home = type(module).__module__  # transformers.models.bert.modeling_bert
    path = inspect.getsourcefile(type(module))
    called: set[type] = set()
    codes: set = set()

    def hook(mod, args, out):
        called.add(type(mod))

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename == path and "." not in code.co_qualname:
            codes.add(code)

    hooks = [m.register_forward_hook(hook) for m in module.modules()]
    sys.setprofile(profile)
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        sys.setprofile(None)
        for h in hooks:
            h.remove()
    classes = {c for c in called if c.__module__ == home}
    return (_class_lines(classes) or 0) + sum(_sloc(inspect.getsource(c)) for c in codes) or None


def _code_lines(src: str) -> int:
    """Code lines up to ``load`` (the SOURCE_SCOPES / SOURCE_NAMES tables after it are data)."""
    return _sloc(src.split("\ndef load(")[0])


def _run(out: Path, inputs):
    spec = importlib.util.spec_from_file_location(f"gen_{out.name}", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, variables = mod.load(out)
    got = model.apply(variables, *inputs)
    return np.asarray(got[0] if isinstance(got, tuple | list) else got)


def measure(name: str, module, inputs) -> dict:
    import torch

    import xconv
    from xconv.converters.flax.source.emitter import FlaxOptions, generate

    with torch.no_grad():
        want = module(*inputs)
    if hasattr(want, "to_tuple"):  # a transformers ModelOutput
        want = want.to_tuple()
    want = want[0] if isinstance(want, tuple | list) else want
    model = xconv.from_torch(module, inputs)
    flat, _ = generate(model, api="linen", options=FlaxOptions(share_blocks=False))
    nnx_src, _ = generate(model, api="nnx")
    with tempfile.TemporaryDirectory() as tmp:
        out = xconv.to_flax(model, Path(tmp) / name, api="linen")
        src = (out / "model.py").read_text()
        got = _run(out, [i.numpy() for i in inputs])
    return {
        "name": name,
        "lines_before": _code_lines(flat),
        "lines": _code_lines(src),
        "lines_nnx": _code_lines(nnx_src),
        "reference": (
            _hf_reference_lines(module, inputs)
            if type(module).__module__.startswith("transformers.")
            else _reference_lines(module)
        ),
        "classes": _classes(src),
        "source_classes": _source_classes(module),
        "exporter_before": _exporter_names(flat, model),
        "exporter": _exporter_names(src, model),
        "max_line": max(len(line) for line in src.splitlines()),
        "parity": float(np.max(np.abs(got - want.numpy()))),
        "helpers": _helpers(src),
        "backend": src.count("default_backend("),
    }


def _helpers(src: str) -> list[str]:
    """The module-level helper functions of a generated ``model.py`` (``def _name``)."""
    return re.findall(r"^def (_\w+)\(", src, flags=re.M)


def measure_torch(name: str, module, variables, inputs, method, classes) -> dict:
    """Generated PyTorch source of a Flax model (``xconv.to_torch_source``)."""
    import jax
    import torch

    import xconv
    from xconv.converters.torch.source import tree as source_tree

    kwargs = {"method": method} if method else {}
    want = jax.tree_util.tree_leaves(module.apply(variables, *inputs, **kwargs))
    model = xconv.from_flax(module, variables, inputs, **kwargs)
    src, state = xconv.to_torch_source(model)
    namespace: dict = {}
    exec(compile(src, name, "exec"), namespace)
    gen = namespace["Model"]()
    gen.load_state_dict(state)
    gen.eval()
    with torch.no_grad():
        got = gen(*(torch.from_numpy(np.asarray(x)) for x in inputs))
    got = got if isinstance(got, tuple | list) else (got,)
    user = set(source_tree.node_classes(model.graph).values())
    user |= set(source_tree.user_classes(model.metadata_props.get("xconv.modules")).values())
    return {
        "name": name,
        "lines_before": None,
        "lines": _code_lines(src),
        "reference": _class_lines(classes),
        "classes": _classes(src) - ("\nclass Scope(nn.Module):" in src),
        "source_classes": len(user) + 1,  # the root
        "exporter_before": None,
        "exporter": _exporter_names(src, model),
        "max_line": max(len(line) for line in src.splitlines()),
        "parity": max(
            float(np.max(np.abs(g.numpy() - np.asarray(w)))) for g, w in zip(got, want, strict=True)
        ),
    }


def _torch_cases():
    """Flax sources for the PyTorch emitter: ``(name, module, variables, inputs, method,
    hand-written classes)``."""
    import jax

    sys.path.insert(0, str(ROOT))
    from fixtures import flax_models

    m, v, x = flax_models.linen_bert()
    yield (
        "bert-shaped (flax fixture)",
        m,
        v,
        x,
        None,
        [
            flax_models.LinenBert,
            flax_models.BertLayer,
            flax_models.BertSelfAttention,
        ],
    )
    m, v, x = flax_models.linen_cnn()
    yield "cnn (flax fixture)", m, v, x, None, [flax_models.LinenCNN]
    m, v, x = flax_models.linen_resnet()
    yield (
        "resnet-shaped (flax fixture)",
        m,
        v,
        x,
        None,
        [flax_models.LinenResNet, flax_models.ResBlock],
    )
    try:
        import flaxmodels
        from flaxmodels.resnet import ops, resnet
    except ImportError:
        return
    m = flaxmodels.ResNet18(output="logits", pretrained=None, num_classes=10)
    x = np.random.default_rng(0).random((2, 32, 32, 3), dtype=np.float32)
    v = m.init(jax.random.PRNGKey(0), x, train=False)
    yield (
        "resnet18 (flaxmodels)",
        m,
        v,
        (x,),
        _eval_call,
        [
            resnet.ResNet,
            resnet.BasicBlock,
            ops.BatchNorm,
        ],
    )


def _eval_call(module, x):
    return module(x, train=False)


def _cases(hf: bool):
    sys.path.insert(0, str(ROOT))
    from fixtures import torch_models

    for name, make in torch_models.FIXTURES.items():
        yield name, *make()
    if hf:
        yield from _hf_cases()


def _hf_cases():
    import torch
    import transformers as tr

    ids = torch.randint(0, 99, (1, 8), generator=torch.Generator().manual_seed(0))
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=99)
    bert = tr.BertModel(tr.BertConfig(intermediate_size=64, **small)).eval()
    yield "bert (tiny)", bert, (ids,)
    gpt2 = tr.GPT2Model(
        tr.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99, use_cache=False)
    ).eval()
    yield "gpt2 (tiny)", gpt2, (ids,)
    llama = tr.LlamaModel(
        tr.LlamaConfig(intermediate_size=64, num_key_value_heads=2, use_cache=False, **small)
    ).eval()
    yield "llama (tiny)", llama, (ids,)
    vit_cfg = tr.ViTConfig(image_size=16, patch_size=8, intermediate_size=64, **small)
    vit = tr.ViTModel(vit_cfg, add_pooling_layer=False).eval()
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    yield "vit (tiny)", vit, (pixels,)
    resnet_cfg = tr.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[2, 2], layer_type="basic"
    )
    resnet = tr.ResNetModel(resnet_cfg).eval()
    images = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    yield "resnet (tiny)", resnet, (images,)


def _table(rows: list[dict]) -> str:
    nnx = any("lines_nnx" in r for r in rows)
    helpers = any("helpers" in r for r in rows)
    head = (
        "| model | code lines (flat -> tree) | hand-written | ratio "
        + ("| nnx lines (ratio) " if nnx else "")
        + "| classes / source classes | exporter names (flat -> tree) | max line | parity "
        + ("| helpers | backend branches " if helpers else "")
        + "|\n|---|---|---|---"
        + ("|---" if nnx else "")
        + "|---|---|---|---"
        + ("|---|---" if helpers else "")
        + "|\n"
    )

    def arrow(a, b) -> str:
        return f"{b}" if a is None else f"{a} -> {b}"

    def ratio(r, key="lines") -> str:
        return f"{r[key] / r['reference']:.2f}x" if r["reference"] else "-"

    def nnx_cell(r) -> str:
        if not nnx:
            return ""
        return f"| {r['lines_nnx']} ({ratio(r, 'lines_nnx')}) " if "lines_nnx" in r else "| - "

    def helper_cells(r) -> str:
        if not helpers:
            return ""
        if "helpers" not in r:
            return "| | "
        names = ", ".join(f"`{h}`" for h in r["helpers"]) or "none"
        return f"| {len(r['helpers'])}: {names} | {r['backend']} "

    return head + "".join(
        f"| {r['name']} | failed: {r['error']} | | | "
        + ("| " if nnx else "")
        + "| | | "
        + helper_cells(r)
        + "|\n"
        if "error" in r
        else f"| {r['name']} | {arrow(r['lines_before'], r['lines'])} | {r['reference'] or '-'} "
        f"| {ratio(r)} {nnx_cell(r)}| {r['classes']} / {r['source_classes']} "
        f"| {arrow(r['exporter_before'], r['exporter'])} | {r['max_line']} "
        f"| {r['parity']:.1e} {helper_cells(r)}|\n"
        for r in rows
    )


def render(rows: list[dict], torch_rows: list[dict], stamp: str = "") -> str:
    return (
        "# Generated code: how it reads\n\n"
        + (f"Run: {stamp}.\n\n" if stamp else "")
        + "Written by `benchmarks/bench_codegen.py` (do not edit). Generated linen `model.py` of\n"
        "each torch source: the flat emitter (`share_blocks=False`) vs the default module tree.\n"
        "Code lines: non-blank lines outside comments and docstrings, up to `load` (the\n"
        "SOURCE_SCOPES / SOURCE_NAMES tables are data), helpers and imports included.\n"
        "Hand-written: the same count over the torch fixture's own classes; for the\n"
        "transformers models, over the modeling file's own classes whose `forward` the tiny\n"
        "model runs (each distinct class's whole source, `inspect.getsource`) plus the\n"
        "module-level functions of that file the run calls (`apply_rotary_pos_emb`); library\n"
        "layers (`torch.nn`, `transformers.activations`, `Conv1D`) and attention kernels\n"
        "outside the modeling file are not counted. Those classes also hold code the tiny\n"
        "config never runs (head pruning, caches, mask variants, position interpolation), so\n"
        "their ratio is lower than a like-for-like rewrite would give. Classes:\n"
        "generated `nn.Module` classes (`Model` included); source classes: distinct torch\n"
        "module classes with children (containers included). Exporter names: assigned locals\n"
        "named after an exported value or an op type. Parity: max abs difference vs torch.\n"
        "Ratio: generated code lines / hand-written lines (target <= 1.3x). nnx lines: the\n"
        "same count for the generated nnx `model.py` (its parity is not run here).\n"
        "Max line: the longest line of the whole file (statements over 100 columns are\n"
        "wrapped as ruff formats them). Helpers: the module-level functions `model.py`\n"
        "defines besides `load`; backend branches: `jax.default_backend()` calls (target 0).\n\n"
        + _table(rows)
        + "\n## PyTorch source from Flax\n\n"
        "Generated `model.py` of `xconv.to_torch_source` for Flax sources (module tree always\n"
        "on, so no flat column). Hand-written: code lines of the Flax source's own classes.\n"
        "Classes: generated classes other than the `Scope` container. Source classes:\n"
        "user-defined Flax module classes on the forward path, the root included. Parity:\n"
        "max abs difference vs Flax.\n\n" + _table(torch_rows)
    )


def _versions() -> str:
    from importlib.metadata import version

    names = ("torch", "jax", "flax", "transformers")
    return ", ".join(f"{n} {version(n)}" for n in names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", action="store_true", help="also tiny transformers models")
    parser.add_argument("--write", action="store_true", help=f"write {DOC.name}")
    parser.add_argument("--out", type=Path, default=DOC, help="where --write writes")
    args = parser.parse_args(argv)
    commit = _doc.commit_or_refuse("bench_codegen", args.out, DOC) if args.write else "-"
    if commit is None:
        return 1
    load = _doc.load()
    rows = []
    for name, m, inputs in _cases(args.hf):
        try:
            rows.append(measure(name, m, inputs))
        except Exception as e:  # a model the emitter cannot write yet: say so in the table
            rows.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:80]}"})
    torch_rows = []
    for name, m, v, x, method, classes in _torch_cases():
        try:
            torch_rows.append(measure_torch(name, m, v, x, method, classes))
        except Exception as e:  # say so in the table
            torch_rows.append({"name": name, "error": f"{type(e).__name__}: {str(e)[:80]}"})
    text = render(rows, torch_rows, _doc.run_stamp(commit, load, _versions()))
    if args.write:
        _doc.write(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
