"""Gated delta rule and causal conv math (engine/kernels/gated_delta.py).

Real: the torch kernels kvmesh runs, transformers' own reference functions from
modeling_qwen3_5 as the oracle; inputs are random, fp32, on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine.kernels import gated_delta as gd
from tests.support.delta_inputs import delta_inputs


def _token_loop(q, k, v, decay, beta, state):
    outs = []
    s = state
    for i in range(q.shape[2]):
        o, s = gd.recurrent_step(q[:, :, i], k[:, :, i], v[:, :, i], decay[:, :, i], beta[:, :, i], s)
        outs.append(o)
    return torch.stack(outs, dim=2), s


@pytest.mark.parametrize("t", [1, 5, 64, 130])
def test_chunked_equals_recurrent(t):
    """The chunked form (WY/UT solves per chunk) and the per-token recurrence agree, from a nonzero state."""
    q, k, v, decay, beta, state = delta_inputs(2, 3, t, 16, 8)
    out_c, s_c, _ = gd.chunked(q, k, v, decay, beta, state)
    out_r, s_r = _token_loop(q, k, v, decay, beta, state)
    torch.testing.assert_close(out_c, out_r, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=1e-4)


def test_chunked_resumes_from_its_own_state():
    """Prefill in two pieces (split off a chunk boundary) equals prefill in one: what chunked prefill relies on."""
    q, k, v, decay, beta, state = delta_inputs(1, 2, 100, 16, 16, seed=3)
    whole, s_whole, _ = gd.chunked(q, k, v, decay, beta, state)
    a, s_a, _ = gd.chunked(q[:, :, :37], k[:, :, :37], v[:, :, :37], decay[:, :, :37], beta[:, :, :37], state)
    b, s_b, _ = gd.chunked(q[:, :, 37:], k[:, :, 37:], v[:, :, 37:], decay[:, :, 37:], beta[:, :, 37:], s_a)
    torch.testing.assert_close(torch.cat([a, b], dim=2), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s_b, s_whole, atol=1e-5, rtol=1e-4)


def test_right_padding_leaves_the_final_state():
    """Zero padding (k = v = beta = decay = 0) past a sequence's end changes neither its outputs nor its state."""
    q, k, v, decay, beta, state = delta_inputs(1, 2, 20, 8, 8, seed=5)
    out, s, _ = gd.chunked(q, k, v, decay, beta, state)
    pad = [F.pad(x, (0, 0, 0, 9)) for x in (q, k, v)] + [F.pad(x, (0, 9)) for x in (decay, beta)]
    out_p, s_p, _ = gd.chunked(*pad, state)
    torch.testing.assert_close(out_p[:, :, :20], out)
    torch.testing.assert_close(s_p, s)


def test_matches_transformers_reference():
    """Same outputs and final state as transformers' torch_chunk_gated_delta_rule (grouped heads, l2norm inside)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    g = torch.Generator().manual_seed(7)
    b, t, hk, hv, dk, dv = 2, 75, 2, 4, 16, 8
    q, k = torch.randn(b, t, hk, dk, generator=g), torch.randn(b, t, hk, dk, generator=g)
    v = torch.randn(b, t, hv, dv, generator=g)
    decay, beta = -torch.rand(b, t, hv, generator=g), torch.rand(b, t, hv, generator=g)
    init = torch.randn(b, hv, dk, dv, generator=g) * 0.1
    want, want_s = ref.torch_chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=init, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    qn = (gd.l2norm(q) * dk ** -0.5).repeat_interleave(hv // hk, dim=2).transpose(1, 2)
    kn = gd.l2norm(k).repeat_interleave(hv // hk, dim=2).transpose(1, 2)
    got, got_s, _ = gd.chunked(qn, kn, v.transpose(1, 2), decay.transpose(1, 2), beta.transpose(1, 2), init)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("t", [20, 100])
def test_captured_states_equal_the_state_of_a_shorter_run(t):
    """The state captured after token j inside the scan equals the final state of a run over the first j
    tokens, for j inside chunks, at chunk ends and at the sequence's end, in a padded batch."""
    q, k, v, decay, beta, state = delta_inputs(2, 2, t, 8, 8, seed=9)
    points = [(0, 1), (1, 7), (0, 16), (1, 64 if t > 64 else t), (0, t), (1, t - 3)]
    _, _, captured = gd.chunked(q, k, v, decay, beta, state, capture=points)
    for i, (b, j) in enumerate(points):
        _, want, _ = gd.chunked(q[b:b + 1, :, :j], k[b:b + 1, :, :j], v[b:b + 1, :, :j], decay[b:b + 1, :, :j],
                                beta[b:b + 1, :, :j], state[b:b + 1])
        torch.testing.assert_close(captured[i], want[0], atol=1e-5, rtol=1e-4)


def test_conv_prefill_then_steps_equal_one_prefill():
    """A conv over T inputs equals a shorter prefill followed by single steps, states carried through."""
    g = torch.Generator().manual_seed(11)
    c, kw, t = 6, 4, 9
    x, w = torch.randn(t, c, generator=g), torch.randn(c, kw, generator=g)
    zero = torch.zeros(c, kw - 1)
    whole, s_whole = gd.causal_conv_prefill(x, w, zero)
    # transformers' form: zero-padded conv over the whole sequence
    want = F.silu(F.conv1d(x.t()[None], w[:, None], padding=kw - 1, groups=c)[0, :, :t]).t()
    torch.testing.assert_close(whole, want)
    head, s = gd.causal_conv_prefill(x[:2], w, zero)  # shorter than the kernel: state keeps zeros
    outs = [head]
    for i in range(2, t):
        y, s = gd.causal_conv_step(x[i:i + 1], w, s.unsqueeze(0))
        s = s[0]
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s, s_whole)


def test_unknown_kernel_set_is_refused():
    """Asking for a kernel set that does not exist names the ones that do."""
    with pytest.raises(ValueError, match="'torch'"):
        gd.gated_delta_kernels("cuda")
