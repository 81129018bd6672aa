"""Small torch models and hand-built IR graphs equivalent to them (with ``xconv.scope``).

The IR builders take knobs that reproduce classic conversion bugs (tanh GELU for exact,
a wrong BatchNorm epsilon, a shifted padding) so tests can check that the parity checker
catches each one and names the right scope.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper, numpy_helper

from xconv.ir import OPSET
from xconv.ir.metadata import SCOPE


def _seeded(module: torch.nn.Module, seed: int = 0) -> None:
    """Re-initialise ``module``'s layers from ``seed`` (torch's default initialisers), so its
    weights do not depend on which tests ran before in the process; the global RNG is left
    as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in module.modules():
            if m is not module and hasattr(m, "reset_parameters"):
                m.reset_parameters()


class Block(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(c)
        self.act = torch.nn.GELU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class SmallCNN(torch.nn.Module):
    """stem conv -> N x (conv, bn, gelu) -> global pool -> flatten -> fc."""

    def __init__(self, c: int = 8, blocks: int = 2, classes: int = 10, seed: int = 0) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
        self.blocks = torch.nn.Sequential(*[Block(c) for _ in range(blocks)])
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.flatten = torch.nn.Flatten()
        self.fc = torch.nn.Linear(c, classes)
        _seeded(self, seed)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                    # Small variances make the epsilon matter, as in trained networks.
                    m.running_var.copy_(torch.rand(c, generator=g) * 0.02 + 0.005)
                    m.weight.copy_(1 + 0.1 * torch.randn(c, generator=g))
                    m.bias.copy_(0.1 * torch.randn(c, generator=g))
        self.eval()

    def forward(self, x):
        return self.fc(self.flatten(self.pool(self.blocks(self.stem(x)))))


class _Builder:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = {k: v.detach().numpy().astype(np.float32) for k, v in state.items()}
        self.nodes: list[onnx.NodeProto] = []
        self.scopes: dict[str, str] = {}
        self.inits: list[onnx.TensorProto] = []
        self.used: set[str] = set()
        self.n = 0

    def weight(self, name: str) -> str:
        if name not in self.used:
            self.used.add(name)
            self.inits.append(numpy_helper.from_array(self.state[name], name))
        return name

    def node(self, op: str, inputs: list[str], scope: str, **attrs) -> str:
        self.n += 1
        out = f"v{self.n}_{op.lower()}"
        name = f"n{self.n}_{op}"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        self.scopes[name] = scope
        return out

    def model(self, x_shape, y: str, y_shape) -> ir.Model:
        graph = helper.make_graph(
            self.nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
            [helper.make_tensor_value_info(y, TensorProto.FLOAT, list(y_shape))],
            self.inits,
        )
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        proto.ir_version = 10
        onnx.checker.check_model(proto)
        model = ir.from_proto(proto)
        for node in model.graph:
            node.metadata_props[SCOPE] = self.scopes[node.name]
        return model


def cnn_ir(
    net: SmallCNN,
    x_shape=(2, 3, 12, 12),
    *,
    gelu: dict[str, str] | None = None,
    bn_eps: dict[str, float] | None = None,
    stem_pads=(1, 1, 1, 1),
) -> ir.Model:
    """The IR of ``net``; ``gelu={"blocks.1.act": "tanh"}``, ``bn_eps={"blocks.0.bn": 1e-3}``
    and ``stem_pads`` inject conversion bugs at one scope."""
    gelu = gelu or {}
    bn_eps = bn_eps or {}
    b = _Builder(net.state_dict())
    h = b.node(
        "Conv",
        ["x", b.weight("stem.weight"), b.weight("stem.bias")],
        "stem",
        pads=list(stem_pads),
        kernel_shape=[3, 3],
    )
    for i in range(len(net.blocks)):
        p = f"blocks.{i}"
        h = b.node(
            "Conv",
            [h, b.weight(f"{p}.conv.weight"), b.weight(f"{p}.conv.bias")],
            f"{p}.conv",
            pads=[1, 1, 1, 1],
            kernel_shape=[3, 3],
        )
        h = b.node(
            "BatchNormalization",
            [
                h,
                *(
                    b.weight(f"{p}.bn.{w}")
                    for w in ("weight", "bias", "running_mean", "running_var")
                ),
            ],
            f"{p}.bn",
            epsilon=bn_eps.get(f"{p}.bn", 1e-5),
        )
        h = b.node("Gelu", [h], f"{p}.act", approximate=gelu.get(f"{p}.act", "none"))
    h = b.node("GlobalAveragePool", [h], "pool")
    h = b.node("Flatten", [h], "flatten", axis=1)
    y = b.node("Gemm", [h, b.weight("fc.weight"), b.weight("fc.bias")], "fc", transB=1)
    return b.model(x_shape, y, [x_shape[0], net.fc.out_features])


class DeepMLP(torch.nn.Module):
    """``depth`` residual blocks ``x + fc2(gelu(fc1(layernorm(x))))``, then a head."""

    def __init__(self, width: int = 64, depth: int = 24, classes: int = 16) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(32, width)
        self.layers = torch.nn.ModuleList(
            [
                torch.nn.ModuleDict(
                    {
                        "norm": torch.nn.LayerNorm(width),
                        "fc1": torch.nn.Linear(width, 2 * width),
                        "act": torch.nn.GELU(),
                        "fc2": torch.nn.Linear(2 * width, width),
                    }
                )
                for _ in range(depth)
            ]
        )
        self.head = torch.nn.Linear(width, classes)
        _seeded(self)
        self.eval()

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer["fc2"](layer["act"](layer["fc1"](layer["norm"](h))))
        return self.head(h)


def mlp_ir(net: DeepMLP, batch: int = 8) -> ir.Model:
    b = _Builder(net.state_dict())
    h = b.node("Gemm", ["x", b.weight("inp.weight"), b.weight("inp.bias")], "inp", transB=1)
    for i in range(len(net.layers)):
        p = f"layers.{i}"
        n = b.node(
            "LayerNormalization",
            [h, b.weight(f"{p}.norm.weight"), b.weight(f"{p}.norm.bias")],
            f"{p}.norm",
            axis=-1,
            epsilon=1e-5,
        )
        n = b.node(
            "Gemm",
            [n, b.weight(f"{p}.fc1.weight"), b.weight(f"{p}.fc1.bias")],
            f"{p}.fc1",
            transB=1,
        )
        n = b.node("Gelu", [n], f"{p}.act")
        n = b.node(
            "Gemm",
            [n, b.weight(f"{p}.fc2.weight"), b.weight(f"{p}.fc2.bias")],
            f"{p}.fc2",
            transB=1,
        )
        h = b.node("Add", [h, n], "")
    y = b.node("Gemm", [h, b.weight("head.weight"), b.weight("head.bias")], "head", transB=1)
    return b.model((batch, 32), y, [batch, net.head.out_features])
