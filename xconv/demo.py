"""The bundled model behind ``xconv demo``."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from xconv.ir.builder import GraphBuilder
from xconv.ir.layers import mark_layer


def build_demo_model(seed: int = 0) -> ir.Model:
    """A small CNN (conv, batch norm, relu, pool, dense) in the IR, weights named by scope."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("demo_cnn")
    x = b.input("x", np.float32, (1, 3, 16, 16))
    w = b.weight(
        "conv.weight",
        rng.normal(0, 0.2, (8, 3, 3, 3)).astype(np.float32),
        role="kernel",
        layout="OIHW",
    )
    cb = b.weight("conv.bias", np.zeros(8, np.float32), role="bias")
    y = b.op(
        "Conv",
        [x, w, cb],
        {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3]},
        scope="conv",
        module="torch.nn.modules.conv.Conv2d",
    )
    mark_layer(
        y.producer(),
        "conv",
        ndim=2,
        in_channels=3,
        out_channels=8,
        kernel_size=[3, 3],
        strides=[1, 1],
        padding=[[1, 1], [1, 1]],
        dilations=[1, 1],
        groups=1,
        use_bias=True,
    )
    bn = [
        b.weight(f"bn.{n}", v, role=r)
        for n, v, r in (
            ("weight", np.ones(8, np.float32), "scale"),
            ("bias", np.zeros(8, np.float32), "bias"),
            ("running_mean", rng.normal(0, 0.1, 8).astype(np.float32), "mean"),
            ("running_var", rng.uniform(0.5, 1.5, 8).astype(np.float32), "var"),
        )
    ]
    y = b.op(
        "BatchNormalization",
        [y, *bn],
        {"epsilon": 1e-5},
        scope="bn",
        module="torch.nn.modules.batchnorm.BatchNorm2d",
    )
    mark_layer(
        y.producer(),
        "batch_norm",
        num_features=8,
        epsilon=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
    )
    y = b.op("Relu", [y], scope="act")
    y = b.op("GlobalAveragePool", [y], scope="pool")
    y = b.op("Flatten", [y], {"axis": 1}, scope="flatten")
    fw = b.weight(
        "fc.weight", rng.normal(0, 0.3, (4, 8)).astype(np.float32), role="kernel", layout="OI"
    )
    fb = b.weight("fc.bias", np.zeros(4, np.float32), role="bias")
    y = b.op(
        "Gemm", [y, fw, fb], {"transB": 1}, scope="fc", module="torch.nn.modules.linear.Linear"
    )
    mark_layer(y.producer(), "dense", in_features=8, out_features=4, use_bias=True)
    return b.build([y])


def build_demo_torch(seed: int = 0):
    """A small ResNet-style torch CNN (conv, batch norm, residual, pooling, dense), eval mode.

    Returns:
        ``(module, example_inputs)``.
    """
    from xconv.errors import require

    torch = require("torch", "torch")
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(c)
            self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(c)

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(x + self.bn2(self.conv2(y)))

    class DemoNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
            self.bn = nn.BatchNorm2d(16)
            self.pool = nn.MaxPool2d(2)
            self.block1 = Block(16)
            self.block2 = Block(16)
            self.head = nn.Linear(16, 10)

        def forward(self, x):
            x = self.pool(torch.relu(self.bn(self.stem(x))))
            x = self.block2(self.block1(x))
            return self.head(x.mean(dim=(2, 3)))

    torch.manual_seed(seed)
    module = DemoNet()
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.6, 1.4)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed + 1))
    return module.eval(), (x,)
