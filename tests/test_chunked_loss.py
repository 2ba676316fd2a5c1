"""The chunked LM-head loss equals linear + cross-entropy, in value and gradients."""

import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error

from lightning_roundpipe.models import chunked_linear_cross_entropy


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
def test_matches_linear_and_cross_entropy(chunk_size, softcap):
    """With ``softcap`` (Gemma), of ``softcap * tanh(logits / softcap)``."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 11))
    labels[0, :5] = -100
    got = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, softcap=softcap)
    (got * 3).backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    (want * 3).backward()
    assert relative_error(got.detach(), want.detach()) < 1e-6
    assert relative_error(gh, hidden.grad) < 1e-6
    assert relative_error(gw, weight.grad) < 1e-6


def test_nothing_counted_gives_zero_and_zero_gradients():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    loss = chunked_linear_cross_entropy(hidden, weight, torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0 and not hidden.grad.any() and not weight.grad.any()


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"do not match labels"):
        chunked_linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))
