"""Models whose weights pass protobuf's 2 GB limit save with external data and load back.

The weights are cheap: ``np.broadcast_to`` views that hold a few KiB each, so the test checks
that saving streams them tensor by tensor (peak RSS far below the model's 2.2 GB).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from xconv.converters.onnx.io import external_bytes, load, save

_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    import onnx_ir as ir
    from xconv.converters.onnx.io import external_bytes, load, save

    rows, cols, n = 34_000, 4096, 4   # 4 x 557 MB float32 = 2.23 GB
    x = ir.Value(name="x", shape=ir.Shape([1, cols]), type=ir.TensorType(ir.DataType.FLOAT))
    weights, nodes, cur = [], [], x
    for i in range(n):
        row = np.arange(cols, dtype=np.float32) * (i + 1)
        w = ir.Value(name=f"w{i}", shape=ir.Shape([rows, cols]),
                     type=ir.TensorType(ir.DataType.FLOAT))
        w.const_value = ir.Tensor(np.broadcast_to(row, (rows, cols)), name=f"w{i}")
        weights.append(w)
        g = ir.node("Gather", [w, ir.Value(name=f"i{i}")], attributes={"axis": 0})
        nodes.append(g)
    idx = []
    for i, g in enumerate(nodes):
        c = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([i], np.int64))})
        g.replace_input_with(1, c.outputs[0])
        idx.append(c)
    add = [ir.node("Add", [x, nodes[0].outputs[0]])]
    for g in nodes[1:]:
        add.append(ir.node("Add", [add[-1].outputs[0], g.outputs[0]]))
    y = add[-1].outputs[0]
    y.name, y.shape, y.type = "y", ir.Shape([1, cols]), ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], [y], nodes=[*idx, *nodes, *add], initializers=weights,
                     opset_imports={"": 23}, name="large")
    model = ir.Model(graph, ir_version=10)
    assert external_bytes(model) > 2**31, external_bytes(model)
    out = sys.argv[1]
    import tracemalloc
    tracemalloc.start()
    save(model, out)
    saved_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    saved_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    back = load(out)
    w2 = back.graph.initializers["w2"].const_value
    assert isinstance(w2, ir.ExternalTensor), type(w2)
    np.testing.assert_array_equal(w2.numpy()[-1], np.arange(cols, dtype=np.float32) * 3)
    print(saved_rss, saved_peak)
    """
)


def test_over_2gb_saves_with_external_data_in_bounded_memory(tmp_path):
    out = tmp_path / "model.onnx"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss_kib, traced = (int(v) for v in proc.stdout.split()[-2:])
    # 2.2 GB of weights, streamed: at most one 557 MB tensor (and its bytes) at a time.
    # (Python-level allocations by tracemalloc; RSS varies with the allocator and load.)
    assert traced < 1.3e9, f"{traced / 2**30:.2f} GiB allocated while saving"
    assert rss_kib > 0
    data = tmp_path / "model.onnx.data"
    assert data.stat().st_size > 2**31
    assert out.stat().st_size < 2**20  # the graph alone
    # onnxruntime reads it too: each row of weight i is arange * (i + 1).
    opts = ort.SessionOptions()
    opts.log_severity_level = 2
    sess = ort.InferenceSession(str(out), opts, providers=["CPUExecutionProvider"])
    x = np.zeros((1, 4096), np.float32)
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y[0], np.arange(4096, dtype=np.float32) * 10)
    del sess


def test_small_model_stays_one_file(tmp_path):
    x = ir.Value(name="x", shape=ir.Shape([1024]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", shape=ir.Shape([1024]), type=ir.TensorType(ir.DataType.FLOAT))
    w.const_value = ir.Tensor(np.arange(1024, dtype=np.float32), name="w")
    node = ir.node("Add", [x, w])
    y = node.outputs[0]
    y.name, y.shape, y.type = "y", ir.Shape([1024]), ir.TensorType(ir.DataType.FLOAT)
    model = ir.Model(
        ir.Graph([x], [y], nodes=[node], initializers=[w], opset_imports={"": 23}, name="g"),
        ir_version=10,
    )
    assert external_bytes(model) == 4096
    out = save(model, tmp_path / "m.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    # Forced external data round-trips, and re-saving the loaded model elsewhere keeps it valid.
    save(model, tmp_path / "e" / "m.onnx", external=True)
    back = load(tmp_path / "e" / "m.onnx")
    save(back, tmp_path / "f" / "m.onnx")
    assert (tmp_path / "f" / "m.onnx.data").is_file()
    again = load(tmp_path / "f" / "m.onnx")
    assert isinstance(again.graph.initializers["w"].const_value, ir.ExternalTensor)
    np.testing.assert_array_equal(again.graph.initializers["w"].const_value.numpy(), range(1024))
    np.testing.assert_array_equal(
        load(out).graph.initializers["w"].const_value.numpy(), range(1024)
    )


def test_unused_state_is_metadata_not_an_initializer(tmp_path, capfd):
    """``num_batches_tracked`` (read by no node) rides in metadata: onnxruntime loads the file
    without "Removing initializer" warnings, and xconv.load gives it back."""
    import torch

    import xconv

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    net[1].num_batches_tracked.fill_(7)
    x = torch.randn(1, 3, 8, 8)
    model = xconv.from_torch(net, (x,))
    assert "1.num_batches_tracked" in model.graph.initializers
    path = xconv.save(model, tmp_path / "m.onnx")
    assert "1.num_batches_tracked" in model.graph.initializers  # the IR is left as it was
    capfd.readouterr()
    opts = ort.SessionOptions()
    opts.log_severity_level = 2  # warnings and above
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(y, net(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    err = capfd.readouterr().err
    assert "Removing initializer" not in err and "[W:" not in err, err
    back = load(path)
    tracked = back.graph.initializers["1.num_batches_tracked"].const_value.numpy()
    assert tracked.dtype == np.int64 and int(tracked) == 7
