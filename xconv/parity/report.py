"""The parity report: JSON, plain text, rich renderable and an HTML page with an inline SVG
plot of the error per scope (no plotting library needed)."""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xconv.parity.localize import ScopeResult
from xconv.parity.metrics import Metrics


@dataclass
class DeviceRun:
    """One (framework, device) row of the matrix, compared with the reference."""

    framework: str
    device: str
    role: str
    passed: bool
    outputs: list[Metrics] = field(default_factory=list)
    error: str | None = None
    seconds: float | None = None
    inputs: str = "example"
    #: The precision the row's float32 dots ran at (``float32``, ``tf32``, ``bf16``,
    #: ``bf16_3x``) and the dot / conv stages its bound grew with (:mod:`.precision`).
    precision: str = "float32"
    dot_depth: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "device": self.device,
            "role": self.role,
            "inputs": self.inputs,
            "precision": self.precision,
            "dot_depth": self.dot_depth,
            "passed": self.passed,
            "error": self.error,
            "seconds": self.seconds,
            "outputs": [m.to_dict() for m in self.outputs],
        }


@dataclass
class ParityReport:
    """What :func:`xconv.check_parity` found.

    Attributes:
        passed: Every candidate row (and the gradients, if checked) is within the policy.
        first_divergence: The first scope whose output is out of tolerance while its
            inputs are within it, or None.
        outputs: Metrics per output on the candidate's first device.
        scopes: Per-scope comparison, in completion order (filled when outputs part).
        matrix: One row per (framework, device).
        grads: Metrics per gradient (inputs ``d/input_i``, weights by name), if checked.
        policy: The policy used (after any fallback).
        notes: Fallbacks and caveats (e.g. no float64 oracle: dtype policy used).
        reason: Why the check failed as a whole (``"vacuous: ..."``), if so.
        input_sets: One entry per input set (name, passed, input shapes); the example
            inputs first, then random and edge draws, then the sets at other shapes
            (``shape_small``, ``shape_large``) of a model with symbolic input dims.
        policy_kind: ``oracle``, ``noise``, ``dtype`` or ``explicit`` after any fallback.
        mesh: The mesh and per-parameter shardings when the candidate ran sharded.
    """

    passed: bool
    reference: str
    candidate: str
    policy: str
    first_divergence: str | None = None
    outputs: list[Metrics] = field(default_factory=list)
    scopes: list[ScopeResult] = field(default_factory=list)
    matrix: list[DeviceRun] = field(default_factory=list)
    grads: list[Metrics] | None = None
    inputs: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    input_sets: list[dict[str, Any]] = field(default_factory=list)
    policy_kind: str | None = None
    #: With ``mesh=``: ``{"shape": {"data": 2, "model": 4}, "params": {path: spec}}``.
    mesh: dict[str, Any] | None = None
    #: Each way the proof is weaker than a float64 oracle judging every block (or the whole
    #: model), as ``{"kind": ..., "message": ...}``: ``noise_policy`` / ``dtype_policy`` (no
    #: float64 twin of the reference), ``merged_blocks`` (a block boundary the candidate
    #: cannot be cut at), ``checked_whole`` (layerwise could not run; the model was checked
    #: whole). Tools and the CLI warn on each; a wrong model can pass a noise-policy check.
    downgrades: list[dict[str, str]] = field(default_factory=list)
    #: The input dimensions the source model fixes (``xconv.fixed_dims`` of the IR): the
    #: candidate runs at any size of every other dimension. None: not recorded (not torch).
    fixed_dims: list[dict[str, Any]] | None = None
    #: A causal LM converted with ``generate=True``: greedy tokens and cached steps against
    #: torch (:mod:`xconv.parity.generation`). None otherwise.
    generation: dict[str, Any] | None = None

    def __bool__(self) -> bool:
        return self.passed

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "verdict": self.verdict,
            "reason": self.reason,
            "reference": self.reference,
            "candidate": self.candidate,
            "policy": self.policy,
            "input_sets": self.input_sets,
            "first_divergence": self.first_divergence,
            "inputs": self.inputs,
            "outputs": [m.to_dict() for m in self.outputs],
            "matrix": [r.to_dict() for r in self.matrix],
            "scopes": [s.to_dict() for s in self.scopes],
            "grads": None if self.grads is None else [m.to_dict() for m in self.grads],
            "downgrades": [dict(d) for d in self.downgrades],
            "notes": list(self.notes),
            "timings": dict(self.timings),
            **({"mesh": self.mesh} if self.mesh is not None else {}),
            **({"fixed_dims": self.fixed_dims} if self.fixed_dims is not None else {}),
            **({"generation": self.generation} if self.generation is not None else {}),
        }

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent, sort_keys=False, default=str)
        if path is not None:
            _atomic_write(Path(path), text)
        return text

    # ------------------------------------------------------------------ text

    @property
    def verdict(self) -> str:
        """One line: PASSED/FAILED, the models, and what the verdict rests on when that is
        weaker than a float64 oracle (noise or dtype policy) or why it failed as a whole."""
        line = (
            f"parity {'PASSED' if self.passed else 'FAILED'}: {self.candidate} vs {self.reference}"
        )
        if self.reason:
            line += f" ({self.reason})"
        if self.policy_kind == "noise":
            line += " [noise policy: the reference has no float64 twin]"
        elif self.policy_kind == "dtype" and any("fell back" in n for n in self.notes):
            line += " [dtype policy: no float64 oracle]"
        failed_sets = [s["name"] for s in self.input_sets if not s["passed"]]
        if failed_sets and len(self.input_sets) > 1:
            line += f" [failing input sets: {', '.join(failed_sets)}]"
        return line

    def summary(self, *, max_scopes: int = 12) -> str:
        """A readable multi-line summary (used by ``assert_parity`` messages)."""
        lines = [self.verdict, f"policy: {self.policy}"]
        if self.input_sets:
            lines.append(self.input_sets_line)
        for row in self.matrix:
            state = "ok" if row.passed else "FAIL"
            extra = f" error: {row.error}" if row.error else ""
            lines.append(
                f"  [{state}] {row.role} {row.framework} on {row.device} inputs={row.inputs} "
                f"precision={row.precision}{extra}"
            )
        if self.outputs:
            lines.append("outputs:")
            lines.extend("  " + format_metrics(m) for m in self.outputs)
        if self.grads is not None:
            bad = [m for m in self.grads if not m.passed]
            lines.append(
                f"gradients: {len(self.grads) - len(bad)}/{len(self.grads)} within tolerance"
            )
            lines.extend("  " + format_metrics(m) for m in bad[:max_scopes])
        if self.first_divergence is not None:
            lines.append(f"first divergence: scope {self.first_divergence!r}")
        if self.scopes:
            shown = [s for s in self.scopes if s.status != "ok"][:max_scopes]
            if shown:
                lines.append("scopes out of tolerance (completion order):")
                for s in shown:
                    lines.append(f"  {s.status:>10} {format_metrics(s.output)}")
        lines.extend(self.mesh_lines())
        lines.extend(f"downgrade: {d['message']}" for d in self.downgrades)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    @property
    def input_sets_line(self) -> str:
        """The input sets and the shapes each ran at, failing ones marked:
        ``input sets: example (2, 8), shape_small (1, 5), shape_large (3, 12) FAIL``."""
        from xconv.parity.shapes import describe_set

        parts = [
            f"{s['name']} {describe_set(s.get('inputs', ()))}" + ("" if s["passed"] else " FAIL")
            for s in self.input_sets
        ]
        return "input sets: " + ", ".join(parts)

    @property
    def closing(self) -> str:
        """The command's last line: the verdict in a few words and every downgrade's kind
        (``parity passed (noise policy: the reference has no float64 twin - a wrong model can
        pass this)``)."""
        line = f"parity {'passed' if self.passed else 'FAILED'}"
        why = [_DOWNGRADE_WORDS.get(d["kind"], d["kind"]) for d in self.downgrades]
        why = list(dict.fromkeys(why))
        if self.policy_kind and not why:
            why.append(f"{self.policy_kind} policy")
        return line + (f" ({'; '.join(why)})" if why else "")

    def mesh_lines(self, max_params: int = 40) -> list[str]:
        """With ``mesh=``: the mesh, then each parameter's sharding (split ones first; the
        whole table is in ``to_dict()["mesh"]``)."""
        if not self.mesh:
            return []
        shape = " x ".join(f"{a}={n}" for a, n in self.mesh.get("shape", {}).items())
        params = self.mesh.get("params", {})
        split = {p: s for p, s in params.items() if s.strip("(),").replace("None", "").strip(", ")}
        lines = [
            f"mesh: {shape}; {len(split)} of {len(params)} parameters split "
            "(PartitionSpec per parameter):"
        ]
        shown = [*split.items(), *((p, s) for p, s in params.items() if p not in split)]
        lines.extend(f"  {p}: {s}" for p, s in shown[:max_params])
        if len(shown) > max_params:
            lines.append(f"  ... {len(shown) - max_params} more (replicated ones last; see JSON)")
        return lines

    def __str__(self) -> str:
        return self.summary()

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        head = Text(self.verdict, style="bold green" if self.passed else "bold red")
        parts: list[Any] = [head, Text(f"policy: {self.policy}")]
        if self.input_sets:
            parts.append(Text(self.input_sets_line))
        matrix = Table(title="framework x device")
        for col in ("role", "framework", "device", "inputs", "precision", "result", "worst output"):
            matrix.add_column(col)
        for row in self.matrix:
            worst = max(row.outputs, key=lambda m: m.severity, default=None)
            matrix.add_row(
                row.role,
                row.framework,
                row.device,
                row.inputs,
                row.precision,
                "[green]ok[/]" if row.passed else "[red]FAIL[/]",
                row.error or (format_metrics(worst) if worst else ""),
            )
        parts.append(matrix)
        if self.outputs:
            parts.append(_metrics_table("outputs", self.outputs))
        if self.grads:
            parts.append(_metrics_table("gradients", self.grads))
        if self.first_divergence:
            parts.append(Text(f"first divergence: {self.first_divergence}", style="bold red"))
        bad = [s for s in self.scopes if s.status != "ok"]
        if bad:
            parts.append(_metrics_table("scopes out of tolerance", [s.output for s in bad[:20]]))
        parts.extend(Text(line) for line in self.mesh_lines())
        parts.extend(Text(f"note: {n}", style="yellow") for n in self.notes)
        return Group(*parts)

    # ------------------------------------------------------------------ HTML

    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """An HTML page: verdict, matrix, metrics tables, and an error-per-scope SVG plot."""
        e = html.escape
        color = "#1a7f37" if self.passed else "#cf222e"
        body = [
            f"<h1 style='color:{color}'>parity {'PASSED' if self.passed else 'FAILED'}</h1>",
            f"<p>{e(self.verdict)}<br>policy: {e(self.policy)}"
            + (f"<br>{e(self.input_sets_line)}" if self.input_sets else "")
            + "</p>",
        ]
        if self.first_divergence:
            body.append(f"<p><b>first divergence:</b> <code>{e(self.first_divergence)}</code></p>")
        body.append(
            "<h2>framework &times; device</h2><table><tr><th>role</th><th>framework</th>"
            "<th>device</th><th>inputs</th><th>precision</th><th>result</th><th>error</th></tr>"
        )
        for r in self.matrix:
            res = "ok" if r.passed else "FAIL"
            body.append(
                f"<tr><td>{e(r.role)}</td><td>{e(r.framework)}</td><td>{e(r.device)}</td>"
                f"<td>{e(r.inputs)}</td><td>{e(r.precision)}</td>"
                f"<td>{res}</td><td>{e(r.error or '')}</td></tr>"
            )
        body.append("</table>")
        body.append(_html_metrics("outputs", self.outputs))
        if self.grads:
            body.append(_html_metrics("gradients", self.grads))
        if self.scopes:
            body.append("<h2>error per scope</h2>")
            body.append(scope_plot_svg(self.scopes, self.first_divergence))
            body.append(_html_metrics("scopes", [s.output for s in self.scopes]))
        if self.notes:
            body.append("<ul>" + "".join(f"<li>{e(n)}</li>" for n in self.notes) + "</ul>")
        page = (
            "<!doctype html><html><head><meta charset='utf-8'><title>xconv parity report</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}</style></head><body>"
            + "\n".join(body)
            + "</body></html>"
        )
        if path is not None:
            _atomic_write(Path(path), page)
        return page


_DOWNGRADE_WORDS = {
    "noise_policy": "noise policy: the reference has no float64 twin - a wrong model can pass this",
    "dtype_policy": "dtype policy: no float64 oracle - judged by float32 tolerances only",
    "merged_blocks": "blocks merged: the candidate cannot be cut at every block boundary",
    "checked_whole": "checked whole: layerwise parity could not run",
}


def format_metrics(m: Metrics) -> str:
    """One line for ``m``; every number may be None, NaN or inf (a block that could not run,
    an output that is not comparable) and still renders."""
    if m.error:
        return f"{m.name}: {m.error}"
    state = "ok" if m.passed else "FAIL"
    parts = [
        f"{m.name} [{state}] {list(m.shape or ())} {m.dtype}: max_abs={fmt(m.max_abs)}",
        f"max_rel={fmt(m.max_rel)}",
        f"mean_abs={fmt(m.mean_abs)}",
        f"ulp_p99={fmt(m.ulp_p99)}",
    ]
    if m.cosine is not None:
        parts.append(f"cos={fmt(m.cosine, '.7f')}")
    if m.argmax_agree is not None:
        parts.append(f"argmax={fmt(m.argmax_agree, '.3f')}")
    if m.topk_agree is not None:
        parts.append(f"top{m.topk}={fmt(m.topk_agree, '.3f')}")
    if m.cand_err is not None or m.ref_err is not None:
        parts.append(f"err_vs_f64={fmt(m.cand_err)} (ref {fmt(m.ref_err)}, bound {fmt(m.bound)})")
    elif m.rtol is not None or m.atol is not None:
        parts.append(f"rtol={fmt(m.rtol, 'g')} atol={fmt(m.atol, 'g')}")
    if m.mismatches:
        parts.append(f"mismatches={m.mismatches} first at {list(m.first_mismatch or ())}")
        worst = [w for w in m.worst if _outside(w)][:3]
        if worst:
            parts.append(
                "worst: "
                + "; ".join(
                    f"{w.get('index')} cand={fmt(w.get('cand'), '.6g')} "
                    f"ref={fmt(w.get('ref'), '.6g')} "
                    f"err={fmt(w.get('err'))} > bound={fmt(w.get('bound'))}"
                    for w in worst
                )
            )
    return " ".join(parts)


def fmt(v: Any, spec: str = ".3g") -> str:
    """``v`` formatted with ``spec``; None as ``-``, NaN and inf as themselves, anything that
    is not a number as its ``str``."""
    if v is None:
        return "-"
    try:
        return format(float(v), spec)
    except (TypeError, ValueError):
        return str(v)


def _outside(w: dict[str, Any]) -> bool:
    """A worst-element row that is out of its bound (or non-finite)."""
    try:
        err, bound, cand = float(w["err"]), float(w["bound"]), float(w["cand"])
    except (KeyError, TypeError, ValueError):
        return True
    return err > bound or not _finite(cand)


def _finite(v: float) -> bool:
    return math.isfinite(v)


def _metrics_table(title: str, metrics: list[Metrics]):
    from rich.table import Table

    t = Table(title=title)
    for col in (
        "name",
        "ok",
        "shape",
        "max_abs",
        "max_rel",
        "ulp_p99",
        "cos",
        "err/bound",
        "mismatches",
    ):
        t.add_column(col)
    for m in metrics:
        t.add_row(
            m.name,
            "[green]ok[/]" if m.passed else "[red]FAIL[/]",
            str(list(m.shape or ())),
            fmt(m.max_abs),
            fmt(m.max_rel),
            fmt(m.ulp_p99),
            "" if m.cosine is None else fmt(m.cosine, ".6f"),
            fmt(m.severity),
            str(m.mismatches) if not m.error else m.error,
        )
    return t


def _html_metrics(title: str, metrics: list[Metrics]) -> str:
    e = html.escape
    cols = (
        "name",
        "passed",
        "shape",
        "dtype",
        "max_abs",
        "max_rel",
        "mean_abs",
        "ulp_p99",
        "cosine",
        "argmax_agree",
        "cand_err",
        "ref_err",
        "bound",
        "mismatches",
    )
    rows = [f"<h2>{e(title)}</h2><table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>"]
    for m in metrics:
        d = m.to_dict()
        cells = []
        for c in cols:
            v = d.get(c)
            cells.append(f"<td>{e(fmt(v, '.4g') if isinstance(v, float) else str(v))}</td>")
        style = "" if m.passed else " style='background:#ffebe9'"
        rows.append(f"<tr{style}>" + "".join(cells) + "</tr>")
    rows.append("</table>")
    return "\n".join(rows)


def scope_plot_svg(
    scopes: list[ScopeResult], first: str | None, width: int = 900, height: int = 260
) -> str:
    """Inline SVG: log10(candidate error / allowed error) per scope; above 0 fails."""
    pad_l, pad_b, pad_t = 50, 70, 15
    n = max(len(scopes), 1)
    vals = []
    for s in scopes:
        v = s.output.severity
        vals.append(3.0 if not math.isfinite(v) else math.log10(max(v, 1e-6)))
    lo, hi = min([-3.0, *vals]), max([1.0, *vals])
    plot_w, plot_h = width - pad_l - 10, height - pad_b - pad_t

    def y(v: float) -> float:
        return pad_t + plot_h * (hi - v) / (hi - lo)

    step = plot_w / n
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"font-family='sans-serif' font-size='10'>"
    ]
    out.append(
        f"<line x1='{pad_l}' x2='{width - 10}' y1='{y(0):.1f}' y2='{y(0):.1f}' "
        "stroke='#cf222e' stroke-dasharray='4 3'/>"
    )
    out.append(f"<text x='{pad_l - 4}' y='{y(0) + 3:.1f}' text-anchor='end'>1x</text>")
    for t in range(math.ceil(lo), math.floor(hi) + 1):
        if t != 0:
            out.append(f"<text x='{pad_l - 4}' y='{y(t) + 3:.1f}' text-anchor='end'>1e{t}</text>")
    for i, (s, v) in enumerate(zip(scopes, vals, strict=True)):
        x = pad_l + i * step
        fill = "#cf222e" if s.name == first else ("#fd8c73" if not s.output.passed else "#2da44e")
        top, base = (y(v), y(lo)) if v >= lo else (y(lo), y(lo))
        out.append(
            f"<rect x='{x + step * 0.1:.1f}' y='{top:.1f}' width='{step * 0.8:.1f}' "
            f"height='{max(base - top, 0.5):.1f}' fill='{fill}'>"
            f"<title>{html.escape(s.name)}: {fmt(s.output.severity)}x allowed</title></rect>"
        )
        if n <= 60:
            lx, ly = x + step / 2, height - pad_b + 8
            out.append(
                f"<text x='{lx:.1f}' y='{ly}' transform='rotate(60 {lx:.1f} {ly})'>"
                f"{html.escape(s.name[-24:])}</text>"
            )
    out.append("</svg>")
    return "".join(out)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
