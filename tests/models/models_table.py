"""Write docs/models.md's results table by running each model through the real CLI.

    python -m tests.models.models_table                 # every model; rewrites the table
    python -m tests.models.models_table bert gpt2       # only these; prints their rows
    python -m tests.models.models_table --update t5_encoder swin   # rerun these rows in place

Each model is built offline from its tiny config (``tests/models/test_hf_models.py``),
exported to ``.pt2`` once, then given to ``xconv torch-to-flax`` (linen), ``xconv
torch-to-flax --api nnx`` and ``xconv torch-to-jax`` through ``click``'s ``CliRunner``. A cell
is the verdict (``pass``, ``FAIL`` for a parity failure, ``exit N`` for another error, or
``export failed``), the worst ``max_abs`` over the outputs in ``parity.json`` and the command's
wall time. The verdicts are what ``test_hf_models.py`` checks against the committed table in
the default suite; the numbers and times are a record of the run.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- models-table:begin -->", "<!-- models-table:end -->"

#: (test_hf_models builder name, row label, tiny config), in table order.
MODELS = [
    ("bert", "BertModel", "2 layers, hidden 32, 4 heads, ffn 64"),
    ("gpt2", "GPT2Model", "2 layers, n_embd 32, 4 heads"),
    ("vit", "ViTModel", "32 px, patch 8, 2 layers, hidden 32"),
    ("resnet", "ResNetModel", "basic blocks, depths [1, 1], widths [8, 16]"),
    ("distilbert", "DistilBertModel", "2 layers, dim 32, 4 heads"),
    ("roberta", "RobertaModel", "as BERT, pad id 1"),
    ("albert", "AlbertModel", "as BERT, embedding 16 (shared layer)"),
    ("electra", "ElectraModel", "as BERT, embedding 16"),
    ("llama", "LlamaModel", "2 layers, 4 q heads / 2 kv heads (GQA), rotary, RMSNorm"),
    ("mistral", "MistralModel", "as Llama"),
    ("qwen2", "Qwen2Model", "as Llama"),
    ("phi", "PhiModel", "2 layers, hidden 32, partial rotary"),
    ("clip_vision", "CLIPVisionModel", "32 px, patch 8, 2 layers"),
    ("deit", "DeiTModel", "32 px, patch 8, 2 layers"),
    ("convnext", "ConvNextModel", "2 stages, depths [1, 1], widths [8, 16]"),
    ("wav2vec2", "Wav2Vec2Model", "2 conv layers (16 ch), 2 layers, hidden 32"),
    ("whisper_encoder", "Whisper encoder", "d_model 32, 2 layers, 16 mel bins"),
    ("t5_encoder", "T5EncoderModel", "d_model 32, 2 layers, 4 heads, sdpa attention"),
    ("swin", "SwinModel", "32 px, patch 4, window 4, depths [2, 1], sdpa attention"),
]
#: (column, CLI command, extra options)
COMMANDS = [
    ("torch-to-flax (linen)", "torch-to-flax", ()),
    ("torch-to-flax --api nnx", "torch-to-flax", ("--api", "nnx")),
    ("torch-to-jax", "torch-to-jax", ()),
]


@dataclass(frozen=True)
class Cell:
    verdict: str  # pass | FAIL | exit N | export failed
    max_abs: float | None = None
    seconds: float | None = None

    def text(self) -> str:
        parts = [self.verdict]
        if self.max_abs is not None:
            parts.append(f"{self.max_abs:.1e}")
        if self.seconds is not None:
            parts.append(f"{self.seconds:.0f} s")
        return ", ".join(parts)


def run_command(pt2: str, out: Path, command: str, options: tuple[str, ...]) -> Cell:
    """One CLI run: its verdict, worst max_abs and wall time."""
    from click.testing import CliRunner

    from xconv.cli import main

    start = time.perf_counter()
    result = CliRunner().invoke(main, [command, pt2, "-o", str(out), *options])
    seconds = time.perf_counter() - start
    parity = out / "parity.json"
    max_abs = None
    if parity.exists():
        outputs = json.loads(parity.read_text()).get("outputs", [])
        values = [o["max_abs"] for o in outputs if isinstance(o.get("max_abs"), int | float)]
        max_abs = max(values) if values else None
    if result.exit_code == 0:
        verdict = "pass"
    elif result.exit_code == 1 and parity.exists():
        verdict = "FAIL"
    else:
        verdict = f"exit {result.exit_code}"
    return Cell(verdict, max_abs, seconds)


def run_model(name: str, where: Path) -> tuple[list[Cell], float | None]:
    """The three commands on one model; ``(cells, export seconds)``."""
    from tests.models.test_hf_models import _export

    start = time.perf_counter()
    try:
        pt2, _, _ = _export(name, where)
    except Exception:  # noqa: BLE001 (recorded in the table)
        return [Cell("export failed") for _ in COMMANDS], None
    export_s = time.perf_counter() - start
    cells = [
        run_command(pt2, where / f"{name}_{i}", command, options)
        for i, (_, command, options) in enumerate(COMMANDS)
    ]
    return cells, export_s


def render(rows: list[tuple[str, str, list[Cell], float | None]]) -> str:
    head = ["model", "tiny config", *(c for c, _, _ in COMMANDS), "export s"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | --- | --- | --- | ---: |"]
    for label, config, cells, export_s in rows:
        export = "" if export_s is None else f"{export_s:.1f}"
        lines.append(f"| {label} | {config} | " + " | ".join(c.text() for c in cells)
                     + f" | {export} |")  # fmt: skip
    return "\n".join(lines)


def doc_verdicts(text: str | None = None) -> dict[tuple[str, str], str]:
    """``{(row label, column): verdict}`` from the committed table."""
    text = DOC.read_text() if text is None else text
    if BEGIN not in text or END not in text:
        return {}
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    columns = [c for c, _, _ in COMMANDS]
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 + len(columns) or cells[0] in ("model", "---"):
            continue
        for column, cell in zip(columns, cells[2:-1], strict=True):
            out[(cells[0], column)] = cell.split(",")[0].strip()
    return out


def write(rows, stamp: str) -> None:
    text = DOC.read_text()
    block = f"{BEGIN}\n{stamp}\n\n{render(rows)}\n{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text,
                      flags=re.S)  # fmt: skip
    else:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} block to replace")
    DOC.write_text(text)


def update(rows, names: list[str], stamp: str) -> None:
    """Replace (or add) the rows of ``names`` in the committed table; keep the others."""
    text = DOC.read_text()
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    lines = [line for line in block.splitlines() if line.startswith("| ")][2:]
    by_label = {line.split("|")[1].strip(): line for line in lines}
    for row in rows:
        by_label[row[0]] = render([row]).splitlines()[-1]
    missing = [label for _, label, _ in MODELS if label not in by_label]
    if missing:
        raise SystemExit(f"no rows for {missing}: run the whole table")
    header = [line for line in block.strip().splitlines() if line and not line.startswith("|")]
    table = render([]).splitlines()[:2] + [by_label[label] for _, label, _ in MODELS]
    notes = [*header, f"Rows {', '.join(names)} rerun by `--update` at {stamp}."]
    new = f"{BEGIN}\n{notes[0]}\n" + "".join(f"{n}\n" for n in notes[1:]) + "\n"
    new += "\n".join(table) + f"\n{END}"
    DOC.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: new, text,
                          flags=re.S))  # fmt: skip


def _commit() -> str:
    """The commit the run starts from, marked when the working tree differs from it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip

    dirty = git("status", "--porcelain", "--untracked-files=no", "xconv", "tests")
    return git("rev-parse", "--short", "HEAD") + (" plus uncommitted changes" if dirty else "")


def main(argv: list[str]) -> int:
    os.environ["HF_HUB_OFFLINE"] = "1"
    updating = bool(argv) and argv[0] == "--update"
    argv = argv[1:] if updating else argv
    names = argv or [m[0] for m in MODELS]
    unknown = set(names) - {m[0] for m in MODELS}
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; known: {[m[0] for m in MODELS]}")
    commit = _commit()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, label, config in MODELS:
            if name not in names:
                continue
            cells, export_s = run_model(name, Path(tmp))
            rows.append((label, config, cells, export_s))
            print(render(rows[-1:]).splitlines()[-1], flush=True)
    if updating:
        stamp = f"commit `{commit}` ({time.strftime('%Y-%m-%d', time.gmtime())})"
        update(rows, names, stamp)
    elif not argv:
        import jax
        import torch
        import transformers

        load = os.getloadavg()[0]
        stamp = (
            f"Written by `python -m tests.models.models_table` at commit `{commit}` "
            f"({time.strftime('%Y-%m-%d', time.gmtime())}; torch {torch.__version__}, "
            f"jax {jax.__version__}, transformers {transformers.__version__}, "
            f"{platform.machine()}, load average {load:.1f} at the end)."
        )
        write(rows, stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
