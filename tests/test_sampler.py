"""The batched sampler on hand-made logits (no model); greedy rows by torch and by the C kernels."""

import pytest
import torch

from appliance.engine.sampler import make_generator, sample
from appliance.engine.sampling import SamplingParams


@pytest.fixture(params=["torch", "kernels"])
def kernels(request):
    """None (greedy rows by torch's max) or the C kernels (their argmax_rows)."""
    return request.getfixturevalue("kernel") if request.param == "kernels" else None


def test_greedy_rows_take_the_first_of_equal_maxima_and_skip_banned_ids(kernels):
    logits = torch.tensor([
        [0.0, 3.0, 3.0, 1.0],  # tie: the first maximum wins, as torch.argmax picks it
        [5.0, 1.0, 5.0, 2.0],  # the first maximum is banned: the second one remains
        [-1.0, -2.0, -0.5, -0.5],
    ])
    greedy = SamplingParams(temperature=0)
    chosen = sample(logits.clone(), [greedy] * 3, [None] * 3, [[], [0], []], kernels)
    assert chosen == [1, 2, 2]
    assert chosen[0] == int(torch.argmax(logits[0])) and chosen[2] == int(torch.argmax(logits[2]))


def test_greedy_matches_argmax_on_a_vocabulary_sized_batch(kernels):
    logits = torch.randn(8, 49152, generator=torch.Generator().manual_seed(0))
    logits[3, 100] = logits[3, 200] = logits[3].max() + 1  # a tie far apart in the row
    chosen = sample(logits.clone(), [SamplingParams(temperature=0)] * 8, [None] * 8, [[]] * 8, kernels)
    assert chosen == torch.argmax(logits, dim=-1).tolist()
    assert chosen[3] == 100


def test_bfloat16_logits_pick_what_their_float32_copy_picks(kernels):
    logits = (torch.randn(6, 49152, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    logits[2, 7] = logits[2, 9000] = logits[2].max() + 1  # a tie: the first one wins either way
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=s)
                                                    for s in range(3)]

    def seeded() -> list:
        return [None] * 3 + [make_generator(p.seed, torch.device("cpu")) for p in params[3:]]

    banned = [[], [int(logits[1].float().argmax())], [], [], [], []]
    chosen = sample(logits.clone(), params, seeded(), banned, kernels)
    assert chosen == sample(logits.float(), params, seeded(), banned, kernels)
    assert chosen[2] == 7 and chosen[1] != banned[1][0]
