"""README.md is executed: every fenced ``bash`` command and ``python`` block runs, in order.

A new user follows the README top to bottom in one folder, so the test does the same: one
working folder (``workdir``) holding the user's own files that the README names — the
``pkg/mod.py`` of ``fixtures/readme`` (``pkg.mod:make_model``, ``pkg.mod:setup``, ...) and the
model files written from it (``FILES``: ``model.pt2``, ``weights.pt``, ...) — where each
command runs after the ones above it (``flax/`` written by one command is read by the next).

Bash commands (``\\``-continued lines joined; ``# ...`` after a command is its comment):

* ``pip install ...`` lines are the newcomer commands CI itself runs: they must appear
  verbatim in ``.ci/run`` and are not run here.
* ``xconv ...`` runs in this process through the console script's entry point
  (``xconv.cli:main``, the same parse and code; a subprocess would pay each framework's import
  again), anything else under ``bash``.
* Checked: the exit code (0, or ``exits N`` in the comment), every path in the comment under
  the command's ``-o`` folder (``flax/model.py``; a ``*`` globs), and for a ``SRC-to-DST``
  conversion that writes ``parity.json``, a verdict that matches the exit code and, unless its
  comment says ``no model.onnx``, ``model.onnx`` (the README's rule for every conversion).
* A comment line ``# docs-test: slow (why)`` right above a command runs it only under
  ``-m slow`` (a real-size or long run); ``# docs-test: skip (why)`` keeps it out (its
  ``--help`` must still run, so the command's name and module stay true).

Python blocks run each in a fresh namespace (they define what they use; a block can ``assert``
its results). A block whose first line is ``# test_NAME.py`` is a pytest file: it is written
there and run by a nested pytest session (the ``xconv_parity`` fixture example).

Adding a command to the README needs no change here, unless it names a new input file: then
one entry in ``FILES``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"#\s*docs-test:\s*(slow|skip)\s*\((.+)\)\s*$")


@dataclass(frozen=True)
class Snippet:
    """One README command or python block."""

    kind: str  # "bash" or "python"
    line: int  # 1-based line in README.md
    code: str
    comment: str = ""
    marker: str | None = None  # "slow" or "skip"
    reason: str = ""

    @property
    def id(self) -> str:
        head = self.code.split("\n", 1)[0] if self.kind == "python" else self.code
        return f"L{self.line}:{head[:100]}"


def _split_comment(line: str) -> tuple[str, str]:
    """``code  # comment`` -> (code, comment), a ``#`` inside quotes kept in the code."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def parse_readme(text: str) -> list[Snippet]:
    """Every command of the ``bash`` blocks and every ``python`` block, in README order."""
    out: list[Snippet] = []
    for m in re.finditer(r"^```(bash|python)\n(.*?)^```", text, re.M | re.S):
        kind, body = m.group(1), m.group(2)
        first = text.count("\n", 0, m.start(2)) + 1
        if kind == "python":
            out.append(Snippet("python", first, body))
            continue
        pending: tuple[str, str] | None = None
        code: list[str] = []
        comment: list[str] = []
        start = first
        for offset, raw in enumerate(body.splitlines()):
            text_, note = _split_comment(raw)
            if not text_:
                marker = MARKER.match(raw.strip())
                if marker:
                    pending = (marker.group(1), marker.group(2).strip())
                elif note and out and out[-1].kind == "bash" and not code:
                    last = out[-1]  # a comment continuing the previous command's
                    out[-1] = Snippet(**{**last.__dict__, "comment": f"{last.comment} {note}"})
                continue
            if not code:
                start = first + offset
            code.append(text_.removesuffix("\\").strip())
            comment.append(note)
            if not text_.endswith("\\"):
                marker, reason = pending or (None, "")
                out.append(
                    Snippet(
                        "bash", start, " ".join(code), " ".join(c for c in comment if c),
                        marker, reason,
                    )
                )  # fmt: skip
                code, comment, pending = [], [], None
    return out


SNIPPETS = parse_readme(README.read_text())
#: The newcomer commands (``pip install ... && xconv demo``; ``... && python -m pytest ...``).
INSTALLS = [s for s in SNIPPETS if s.kind == "bash" and "pip install" in s.code]
#: What runs here: every other snippet, and what an install command runs after installing
#: (``xconv demo``) but for the last one (the test suite, which is what CI ends with).
RUN = [
    s if s not in INSTALLS else Snippet(**{**s.__dict__, "code": s.code.split(" && ")[-1]})
    for s in SNIPPETS
    if s not in INSTALLS[-1:]
]


# -- the user's files -------------------------------------------------------------------------


def _user_module(workdir: Path):
    """The user's ``pkg/mod.py``, imported from its file: ``pkg`` itself stays importable
    only as the CLI makes it (from the working folder), so the commands prove they do."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_readme_pkg_mod", workdir / "pkg" / "mod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _torch_files(workdir: Path) -> None:
    import torch

    make_model = _user_module(workdir).make_model

    module = make_model()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.export.save(torch.export.export(module, (x,)), workdir / "model.pt2")
    torch.save(module.state_dict(), workdir / "weights.pt")


def _onnx_file(workdir: Path) -> None:
    import xconv
    from xconv.demo import build_demo_model

    xconv.save(build_demo_model(), workdir / "model.onnx")


def _flax_variables(workdir: Path) -> None:
    import flax.serialization
    import jax

    module, inputs = _user_module(workdir).make_flax_model()
    variables = module.init(jax.random.PRNGKey(0), *inputs)
    (workdir / "vars.msgpack").write_bytes(flax.serialization.to_bytes(variables))


def _train_checkpoint(workdir: Path) -> None:
    import torch

    s = _user_module(workdir).setup()
    state = {
        "model": s["module"].state_dict(),
        "optimizer": s["optimizer"].state_dict(),
        "scheduler": s["scheduler"].state_dict(),
        "step": 0,
    }
    torch.save(state, workdir / "ckpt.pt")


def _tiny_llama(vocab_size: int):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _llama_checkpoint(workdir: Path) -> None:
    # config.json + model-*.safetensors shards
    _tiny_llama(128).save_pretrained(workdir, max_shard_size="20KB")


def _traced_file(workdir: Path) -> None:
    import torch

    module = _user_module(workdir).make_model()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.jit.trace(module, (x,)).save(str(workdir / "traced.pt"))


def _pickled_module(workdir: Path) -> None:
    """``torch.save(model)`` of the user's class, importable as ``pkg.mod`` from the folder."""
    code = "import torch, pkg.mod as m; torch.save(m.make_model(), 'module.pt')"
    subprocess.run([sys.executable, "-c", code], cwd=workdir, check=True)


def _hf_folder(workdir: Path) -> None:
    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(workdir / "tinybert")


def _causal_lm_folder(workdir: Path) -> None:
    _tiny_llama(96).save_pretrained(workdir / "tinyllama")


#: A file name as the README writes it -> what writes it into the working folder (only the
#: files some snippet names are written).
FILES: dict[str, Callable[[Path], None]] = {
    "model.pt2": _torch_files,
    "weights.pt": _torch_files,
    "model.onnx": _onnx_file,
    "vars.msgpack": _flax_variables,
    "ckpt.pt": _train_checkpoint,
    "config.json": _llama_checkpoint,
    "traced.pt": _traced_file,
    "module.pt": _pickled_module,
    "tinybert": _hf_folder,
    "tinyllama": _causal_lm_folder,
}


def _named(name: str, code: str) -> bool:
    return re.search(rf"(?<![\w/.-]){re.escape(name)}(?![\w.-])", code) is not None


class Workdir:
    """The README's working folder; ``prepare`` writes the user's files a snippet names."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: set[Callable[[Path], None]] = set()

    def prepare(self, snippet: Snippet) -> None:
        for name, write in FILES.items():
            if _named(name, snippet.code) and write not in self._written:
                write(self.path)
                self._written.add(write)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "fixtures" / "readme" / "pkg", path / "pkg")
    old = Path.cwd()
    os.chdir(path)
    try:
        yield Workdir(path)
    finally:
        os.chdir(old)


# -- running ----------------------------------------------------------------------------------


def _out_dir(argv: list[str]) -> str | None:
    for flag in ("-o", "--out"):
        if flag in argv[:-1]:
            return argv[argv.index(flag) + 1].rstrip("/")
    return None


def run_command(snippet: Snippet, workdir: Path) -> tuple[int, str]:
    argv = shlex.split(snippet.code)
    shell_only = any(t in snippet.code for t in ("|", "&&", ";", ">", "$"))
    if argv[0] == "xconv" and not shell_only:
        from click.testing import CliRunner

        from xconv.cli import main

        # As the console script runs it: the working folder is not on sys.path (pytest's ''
        # is), and the user's modules are imported afresh by each command.
        saved = list(sys.path)
        sys.path[:] = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != workdir]
        try:
            r = CliRunner().invoke(main, argv[1:], catch_exceptions=False)
        finally:
            sys.path[:] = saved
            for mod in [m for m in sys.modules if m == "pkg" or m.startswith("pkg.")]:
                del sys.modules[mod]
        return r.exit_code, r.output
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(workdir)])}
    r = subprocess.run(
        snippet.code, shell=True, cwd=workdir, env=env, capture_output=True, text=True
    )
    return r.returncode, r.stdout + r.stderr


def check_command(snippet: Snippet, workdir: Path) -> None:
    code, output = run_command(snippet, workdir)
    expected = re.search(r"\bexits (\d+)\b", snippet.comment)
    want = int(expected.group(1)) if expected else 0
    assert code == want, f"README line {snippet.line}: `{snippet.code}` exited {code}\n{output}"
    argv = shlex.split(snippet.code)
    out = _out_dir(argv)
    if out is None:
        return
    for path in re.findall(rf"(?<![\w/.-]){re.escape(out)}/[\w.*/-]+", snippet.comment):
        path = path.rstrip(".,;:")
        assert list(workdir.glob(path)), f"README line {snippet.line}: {path} not written"
    if re.fullmatch(r"[a-z]+-to-[a-z]+", argv[1]) and (workdir / out / "parity.json").is_file():
        import json

        if "no model.onnx" not in snippet.comment:  # the README's rule, or the exception named
            assert (workdir / out / "model.onnx").is_file(), f"{out}/model.onnx not written"
        verdict = json.loads((workdir / out / "parity.json").read_text())
        assert verdict["passed"] is (code == 0), verdict["verdict"]


def run_python(snippet: Snippet, workdir: Path) -> None:
    first = snippet.code.split("\n", 1)[0]
    test_file = re.fullmatch(r"#\s*(test_\w+\.py)\s*", first)
    if test_file:
        # In this process (its frameworks already imported), as a fresh pytest session that
        # loads the installed plugins, xconv's fixture among them; OK means tests ran and passed.
        path = workdir / test_file.group(1)
        path.write_text(snippet.code)
        args = ["-q", "-p", "no:cacheprovider", "--rootdir", str(workdir), str(path)]
        assert pytest.main(args) == pytest.ExitCode.OK, f"README line {snippet.line}"
        return
    code = compile(snippet.code, f"README.md:{snippet.line}", "exec")
    exec(code, {"__name__": "__readme__"})


def _params():
    for s in RUN:
        marks = [pytest.mark.slow] if s.marker == "slow" else []
        yield pytest.param(s, id=s.id, marks=marks)


@pytest.mark.parametrize("snippet", list(_params()))
def test_readme_snippet(snippet: Snippet, workdir: Workdir) -> None:
    if snippet.marker == "skip":
        assert snippet.reason
        argv = shlex.split(snippet.code)
        cut = next((i for i, a in enumerate(argv) if i and a.startswith("-")), len(argv))
        help_cmd = shlex.join([*argv[:cut], "--help"])
        r = subprocess.run(help_cmd, shell=True, cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, f"README line {snippet.line}: `{help_cmd}`\n{r.stderr}"
        return
    workdir.prepare(snippet)
    if snippet.kind == "python":
        run_python(snippet, workdir.path)
    else:
        check_command(snippet, workdir.path)


def test_install_commands_are_what_ci_runs() -> None:
    """CI's last line is the README's test command; the demo command installs what it does
    (``.[all]`` of its ``.[all,dev]``), and its ``xconv demo`` runs above."""
    ci = (ROOT / ".ci" / "run").read_text().rstrip().splitlines()
    assert len(INSTALLS) == 2, [s.code for s in INSTALLS]
    demo, tests = INSTALLS
    assert ci[-1] == tests.code, f"README line {tests.line}: not what .ci/run ends with"
    *installs, run = demo.code.split(" && ")
    assert run == "xconv demo" and installs == [
        "pip install torch==2.13.0",
        'pip install -e ".[all]"',
    ], demo.code
    assert tests.code.startswith('pip install torch==2.13.0 && pip install -e ".[all,dev]" && ')


def test_parser_reads_commands_comments_and_markers() -> None:
    text = (
        "x\n```bash\n"
        "xconv a b -o out/   # out/model.py, and\n"
        "                    # out/x.json\n"
        "# docs-test: slow (a big model)\n"
        "xconv c \\\n    --d 'e #f' -o o/  # exits 1\n"
        "```\n```python\nimport os\n```\n"
    )
    a, c, p = parse_readme(text)
    assert (a.line, a.code, a.comment) == (3, "xconv a b -o out/", "out/model.py, and out/x.json")
    assert (c.line, c.code, c.marker, c.reason) == (
        6,
        "xconv c --d 'e #f' -o o/",
        "slow",
        "a big model",
    )
    assert c.comment == "exits 1" and (p.kind, p.line, p.code) == ("python", 10, "import os\n")
    assert len(SNIPPETS) > 10 and all(s.reason for s in SNIPPETS if s.marker)
