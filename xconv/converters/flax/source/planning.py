"""The Flax emitter's layer planning: which ``xconv.layer`` groups become native Flax
layers or generated submodules (a mixin of ``emitter._Emitter``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from xconv.converters.codegen import subgraphs
from xconv.converters.flax.source import templates_resize as flax_ops_resize  # noqa: F401  (registers templates)
from xconv.converters.flax.source.templates import (
    find_template,
)
from xconv.ir.metadata import ROLE, get_layer, get_scope
from xconv.ir.passes._utils import constant_of, is_weight
from xconv.weights.flax_names import (
    DROPPED_ROLES,
    FLAX_VARIABLES,
)


@dataclass
class LayerPlan:
    kind: str
    hyper: dict[str, Any]
    anchor: ir.Node
    body: list[ir.Node]
    scope: str | None
    inputs: list[ir.Value]
    outputs: list[ir.Value]
    weights: dict[str, ir.Value]
    #: False: no native Flax layer fits; the body becomes a generated submodule class.
    native: bool = True
    last: ir.Node | None = None

    @property
    def input(self) -> ir.Value:
        return self.inputs[0]

    @property
    def output(self) -> ir.Value:
        return self.outputs[0]


class _Planning:
    """Layer plans of ``_Emitter`` (``self.plans``)."""

    # ------------------------------------------------------------ planning

    def plan_layers(self) -> None:
        by_scope: dict[str, list[ir.Node]] = {}
        for node in self.graph:
            scope = get_scope(node)
            if scope:
                by_scope.setdefault(scope, []).append(node)
        for node in self.graph:
            meta = get_layer(node)
            if not meta or node in self.plans:
                continue
            scope = get_scope(node)
            body = by_scope.get(scope, [node]) if scope else [node]
            plan = self._plan(node, meta, body, scope)
            if plan is not None:
                for n in body:
                    self.plans[n] = plan
        if self.options.share_blocks:
            self.plan_blocks()

    def _plan(self, anchor, meta, body, scope) -> LayerPlan | None:
        kind = meta.pop("kind")
        if any(subgraphs(n) for n in body):
            return None  # a subgraph reads values its node does not list: the nodes stay inline
        body_set = set(body)
        inputs, weights, outputs = [], {}, []
        for n in body:
            for v in n.inputs:
                if v is None or not v.name or v.producer() in body_set:
                    continue
                if is_weight(v, self.annotated):
                    role = v.metadata_props.get(ROLE)
                    if role is None or weights.get(role, v) is not v:
                        return None
                    weights[role] = v
                elif constant_of(v, self.annotated) is None and v not in inputs:
                    inputs.append(v)
            if n.op_type == "Constant":
                continue  # constants are inlined wherever they are used
            for o in n.outputs:
                outside = any(u.node not in body_set for u in o.uses())
                if outside or o.is_graph_output():
                    outputs.append(o)
        if not inputs or not outputs:
            return None
        order = {n: i for i, n in enumerate(self.graph)}
        last = max(body, key=order.__getitem__)
        for o in outputs:
            if any(
                u.node not in body_set and order.get(u.node, len(order)) < order[last]
                for u in o.uses()
            ):
                return None  # a consumer sits between body nodes: keep the ops inline
        plan = LayerPlan(kind, meta, anchor, body, scope, inputs, outputs, weights, last=last)
        if len(inputs) == 1 and len(outputs) == 1 and self._plan_ok(plan):
            return plan
        plan.native = False
        if not weights:
            return None  # weightless (pooling, activations, ...): its ops inline are clearer
        if scope is None or any(n.op_type != "Constant" and find_template(n) is None for n in body):
            return None
        return plan

    def _plan_ok(self, p: LayerPlan) -> bool:
        roles = set(p.weights) - DROPPED_ROLES
        known = set(FLAX_VARIABLES.get(p.kind, {}))
        if not roles <= known:
            return False
        h = p.hyper
        if (
            p.kind in ("conv", "conv_transpose", "batch_norm", "group_norm")
            and p.input.shape is None
        ):
            return False  # the channel axis must be known to move it last
        if p.kind == "dense":
            return "kernel" in roles and ("bias" in roles) == bool(h["use_bias"])
        if p.kind == "conv":
            return (
                "kernel" in roles
                and ("bias" in roles) == bool(h["use_bias"])
                and h.get("padding_mode", "zeros") in (None, "zeros")
                and 1 <= h["ndim"] <= 3
            )
        if p.kind == "conv_transpose":
            attrs = p.anchor.attributes
            return (
                self.options.native_conv_transpose
                and p.anchor.op_type == "ConvTranspose"
                and "kernel" in roles
                and ("bias" in roles) == bool(h["use_bias"])
                and h["groups"] == 1
                and 1 <= h["ndim"] <= 3
                and "output_shape" not in attrs
                and getattr(attrs.get("auto_pad"), "value", "NOTSET") == "NOTSET"
            )
        if p.kind == "batch_norm":
            # torch's momentum=None (a cumulative average) has no Flax equivalent: rather
            # than guess a momentum, such a layer stays a generated (inference) class.
            return (
                {"mean", "var"} <= roles
                and bool(h["track_running_stats"])
                and h["momentum"] is not None
            )
        if p.kind == "layer_norm":
            return len(h["normalized_shape"]) == 1
        if p.kind in ("group_norm", "rms_norm"):
            return True
        if p.kind == "embedding":
            return "embedding" in roles
        return p.kind == "dropout"
