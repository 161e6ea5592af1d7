"""Equal packed constants of compiled graphs kept once (``serve/exec/shared_constants.py``), on
stand-in graph modules: what is shared, what never is, and every holder pointed at one copy."""

from __future__ import annotations

import gc
import types
import weakref

import torch

from kvshare.serve.exec.shared_constants import MIN_BYTES, share_constants

ROWS = MIN_BYTES // 4 // 64  # a (ROWS, 64) float32 constant is just worth sharing


def _graph(name: str, **constants: torch.Tensor) -> tuple[types.ModuleType, dict]:
    """A stand-in for one loaded graph: its module's globals and the compiled graph's own dict."""
    module = types.ModuleType(name)
    for key, value in constants.items():
        setattr(module, key, value)
    return module, dict(constants)


def test_a_later_graphs_equal_constants_become_the_earlier_ones_everywhere():
    weight = torch.randn(ROWS, 64)
    first, _ = _graph("graph_a", packed=weight)
    share_constants([first])
    second, record = _graph("graph_b", packed=weight.clone(), other=torch.randn(ROWS, 64))
    copy = weakref.ref(second.packed)
    freed = share_constants([second])
    assert freed == weight.numel() * 4
    assert second.packed is weight and record["packed"] is weight  # the module and the dict holding it
    assert record["other"] is second.other  # nothing equal to it before: kept
    del record
    gc.collect()
    assert copy() is None  # the copy is gone


def test_constants_that_differ_in_a_value_layout_or_size_stay_apart():
    weight = torch.randn(ROWS, 64)
    share_constants([_graph("graph_c", packed=weight, small=torch.ones(4))[0]])
    changed = weight.clone()
    changed[-1, -1] += 1  # one element apart
    transposed = weight.t().contiguous().t()  # equal values, other strides
    wider = torch.cat([weight, weight[:1]])
    module, _ = _graph("graph_d", changed=changed, transposed=transposed, wider=wider, small=torch.ones(4))
    before = dict(vars(module))
    assert share_constants([module]) == 0
    assert all(vars(module)[k] is before[k] for k in ("changed", "transposed", "wider", "small"))


def test_two_equal_constants_of_one_new_graph_become_one():
    weight = torch.randn(ROWS, 64)
    module, _ = _graph("graph_e", a=weight, b=weight.clone())
    assert share_constants([module]) == weight.numel() * 4
    assert module.a is module.b


def test_a_tensor_something_else_holds_is_left_alone():
    """A graph that froze a model's parameter as it is holds that parameter: never replaced,
    even where it equals an earlier constant (two norm weights of ones)."""
    norm = torch.nn.Linear(64, ROWS, bias=False).requires_grad_(False)  # frozen, as for inference
    first, _ = _graph("graph_f", norm_a=norm.weight.detach().clone())
    share_constants([first])
    module, record = _graph("graph_g", norm_b=norm.weight)
    assert share_constants([module]) == 0
    assert module.norm_b is norm.weight and record["norm_b"] is norm.weight


def test_bfloat16_constants_are_shared_too():
    weight = torch.randn(ROWS, 128).bfloat16()
    first, _ = _graph("graph_h", packed=weight)
    share_constants([first])
    second, _ = _graph("graph_i", packed=weight.clone())
    assert share_constants([second]) == weight.numel() * 2 and second.packed is weight
