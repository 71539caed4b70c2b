"""The replica audit's fingerprints and comparison (pure; the live audit is in test_stragglers_live)."""

from __future__ import annotations

import pytest
import torch

from resilient.core.errors import ConfigError
from resilient.run.audit import checked_every, compare, fingerprints


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_a_one_ulp_change_in_one_element_changes_that_tensor_s_fingerprint_only():
    a, b = model(), model()
    names, fa = fingerprints(a)
    with torch.no_grad():
        w = b[2].weight.view(-1)
        w[5] = torch.nextafter(w[5], torch.tensor(1e9))
    _, fb = fingerprints(b)
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [bool((x != y).any()) for x, y in zip(fa, fb, strict=True)] == [False, False, True, False]


def test_two_elements_swapped_are_seen_by_the_every_other_element_sum():
    a, b = model(), model()
    with torch.no_grad():
        w = b[0].bias
        w[0], w[1] = w[1].item(), w[0].item()
    assert not torch.equal(fingerprints(a)[1][1], fingerprints(b)[1][1])


def test_the_minority_ranks_and_their_tensors_are_named():
    names, good = fingerprints(model())
    bad = good.clone()
    bad[2, 0] += 1
    assert compare(names, [good, good, good]) is None
    found = compare(names, [good, good, bad, good])
    assert found == {"ranks": [2], "tensors": [{"tensor": "2.weight", "ranks": [2]}], "tensors_differing": 1,
                     "of_tensors": 4, "world_size": 4}


def test_audit_every_must_be_a_number_of_steps():
    assert checked_every(0) == 0 and checked_every(50) == 50
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(ConfigError, match="audit_every"):
            checked_every(bad)
