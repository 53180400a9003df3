"""Triton gated delta rule (engine/kernels/gated_delta_triton.py) against the torch reference.

Real: the Triton kernels kvmesh launches on CUDA, run here by Triton's CPU interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py), and the torch reference ``gated_delta.chunked``
/ ``recurrent_step`` (itself tested against transformers in test_gated_delta.py) as the oracle.
Inputs are random fp32 with the engine's normalisation, small enough for the interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine.kernels import gated_delta as gd
from kvmesh.engine.kernels.gated_delta_triton import chunked_triton, recurrent_step_triton
from tests.support.delta_inputs import delta_inputs

TOL = {"atol": 2e-5, "rtol": 1e-4}


@pytest.mark.parametrize(("b", "h", "t", "dk", "dv", "with_state"), [
    (1, 1, 1, 16, 16, True),  # one token: a 16-row chunk with 15 padded rows
    (2, 3, 5, 16, 8, False),  # Dv under the 16-wide tile, no initial state
    (1, 4, 37, 32, 16, True),  # Dk != Dv
    (2, 2, 70, 8, 32, True),  # a 64-row chunk and a 6-row tail
    (1, 2, 130, 24, 24, False),  # head dims that are not powers of two, three chunks
])
def test_chunked_matches_reference(b, h, t, dk, dv, with_state):
    """Outputs and final state equal the torch chunked scan for head counts, lengths that are not chunk
    multiples, and zero or random initial states."""
    x = delta_inputs(b, h, t, dk, dv, seed=t, with_state=with_state)
    out, final, captured = chunked_triton(*x)
    want_out, want_final, _ = gd.chunked(*x)
    assert captured is None and out.shape == want_out.shape and final.shape == want_final.shape
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(final, want_final, **TOL)


def test_chunk_size_argument_changes_no_result():
    """The reference's 64-token chunk instead of the kernels' 16 gives the same result: only the cost differs."""
    x = delta_inputs(1, 2, 100, 16, 16, seed=4)
    out64, s64, _ = chunked_triton(*x, chunk=64)
    want_out, want_s, _ = gd.chunked(*x)
    torch.testing.assert_close(out64, want_out, **TOL)
    torch.testing.assert_close(s64, want_s, **TOL)


def test_varlen_batch_right_padded_as_the_engine_does():
    """Sequences of 3, 64, 29 and 90 tokens in one right-padded call, laid out as the engine passes them
    ([P, T, H, D] transposed, not contiguous): each sequence's outputs and final state equal its own
    unpadded reference run; the padding leaves the states unchanged."""
    lens, h, dk, dv = [3, 64, 29, 90], 2, 16, 16
    per_seq = [delta_inputs(1, h, n, dk, dv, seed=10 + i) for i, n in enumerate(lens)]

    def padded(j: int) -> torch.Tensor:  # [P, H, T_max, ...] as deltanet's pad(): a strided view
        parts = [x[j][0].transpose(0, 1) for x in per_seq]  # [T, H, ...]
        return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True).transpose(1, 2)

    q, k, v, decay, beta = (padded(j) for j in range(5))
    assert not q.is_contiguous() and not decay.is_contiguous()
    init = torch.cat([x[5] for x in per_seq])
    out, final, _ = chunked_triton(q, k, v, decay, beta, init)
    for i, (n, x) in enumerate(zip(lens, per_seq)):
        want_out, want_final, _ = gd.chunked(*x)
        torch.testing.assert_close(out[i:i + 1, :, :n], want_out, **TOL)
        torch.testing.assert_close(final[i:i + 1], want_final, **TOL)


def test_captures_equal_the_reference_and_shorter_runs():
    """Captured states (unsorted, several per sequence, inside chunks, at chunk ends, at a sequence's
    end, none for one sequence) equal the reference's captures and the final state of a run over
    that many tokens."""
    t = 100
    x = delta_inputs(3, 2, t, 16, 16, seed=21)
    points = [(2, t), (0, 1), (2, 64), (0, 16), (2, 65), (0, 63), (2, 7), (0, t - 3)]
    out, final, captured = chunked_triton(*x, capture=points)
    want_out, want_final, want_captured = gd.chunked(*x, capture=points)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(final, want_final, **TOL)
    torch.testing.assert_close(captured, want_captured, **TOL)
    q, k, v, decay, beta, state = x
    for i, (b, j) in enumerate(points):
        _, shorter, _ = gd.chunked(q[b:b + 1, :, :j], k[b:b + 1, :, :j], v[b:b + 1, :, :j],
                                   decay[b:b + 1, :, :j], beta[b:b + 1, :, :j], state[b:b + 1])
        torch.testing.assert_close(captured[i], shorter[0], **TOL)


def test_prefill_in_pieces_then_decode_steps():
    """A prompt scanned in two pieces (the second from the first's state), then single recurrent
    steps, all Triton, equals the reference scan over the whole sequence: chunked prefill resuming
    from a slot, then decode."""
    q, k, v, decay, beta, state = delta_inputs(2, 2, 45, 16, 16, seed=30)
    want_out, want_final, _ = gd.chunked(q, k, v, decay, beta, state)
    cut, steps = 23, 40
    a, s, _ = chunked_triton(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], decay[:, :, :cut], beta[:, :, :cut], state)
    b, s, _ = chunked_triton(q[:, :, cut:steps], k[:, :, cut:steps], v[:, :, cut:steps], decay[:, :, cut:steps],
                             beta[:, :, cut:steps], s)
    outs = [a, b]
    for i in range(steps, 45):
        o, s = recurrent_step_triton(q[:, :, i], k[:, :, i], v[:, :, i], decay[:, :, i], beta[:, :, i], s)
        outs.append(o.unsqueeze(2))
    torch.testing.assert_close(torch.cat(outs, dim=2), want_out, **TOL)
    torch.testing.assert_close(s, want_final, **TOL)


@pytest.mark.parametrize(("b", "h", "dk", "dv"), [(1, 1, 16, 16), (5, 3, 32, 16), (3, 4, 24, 80)])
def test_recurrent_step_matches_reference(b, h, dk, dv):
    """One decode step for a batch: same output and new state as the reference; the input state is
    left as it was."""
    x = delta_inputs(b, h, 1, dk, dv, seed=b + h)
    q, k, v, decay, beta = (t[:, :, 0] for t in x[:5])  # token 0 of each sequence
    state = x[5]
    before = state.clone()
    out, new = recurrent_step_triton(q, k, v, decay, beta, state)
    want_out, want_new = gd.recurrent_step(q, k, v, decay, beta, state)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(new, want_new, **TOL)
    assert torch.equal(state, before)


def test_zero_length_and_padding_only():
    """T = 0 returns the state unchanged; a sequence that is all padding keeps its state exactly."""
    x = delta_inputs(1, 2, 0, 16, 16)
    out, final, _ = chunked_triton(*x)
    assert out.shape == (1, 2, 0, 16) and torch.equal(final, x[5])
    q, k, v, decay, beta, state = delta_inputs(1, 2, 9, 16, 16, seed=2)
    zeros = [F.pad(t[:, :, :0], (0, 0, 0, 9)) for t in (q, k, v)] + [torch.zeros(1, 2, 9)] * 2
    _, final, _ = chunked_triton(*zeros, state)
    torch.testing.assert_close(final, state, atol=0, rtol=0)


def test_bad_inputs_are_refused():
    """Non-fp32 inputs, a mis-shaped state and captures outside the sequence get clear errors."""
    q, k, v, decay, beta, state = delta_inputs(1, 1, 8, 16, 16)
    with pytest.raises(ValueError, match="fp32"):
        chunked_triton(q.bfloat16(), k, v, decay, beta, state)
    with pytest.raises(ValueError, match="state must be"):
        chunked_triton(q, k, v, decay, beta, state[:, :, :8])
    with pytest.raises(ValueError, match="outside 1..8"):
        chunked_triton(q, k, v, decay, beta, state, capture=[(0, 9)])
    with pytest.raises(ValueError, match="sequence 1"):
        chunked_triton(q, k, v, decay, beta, state, capture=[(1, 3)])
    with pytest.raises(ValueError, match="power of two"):
        chunked_triton(q, k, v, decay, beta, state, chunk=48)


def test_kernel_set_selection():
    """"triton" names the Triton scan and step (the conv stays torch); "torch" the references."""
    tri, ref = gd.gated_delta_kernels("triton"), gd.gated_delta_kernels("torch")
    assert (tri.chunked, tri.recurrent_step) == (chunked_triton, recurrent_step_triton)
    assert tri.conv_prefill is ref.conv_prefill and ref.chunked is gd.chunked
