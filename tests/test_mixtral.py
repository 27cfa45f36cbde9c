"""The Mixtral config: the published 8x7B shape's exact parameter count, active parameters
per token, and clear errors for impossible routing."""

import pytest

from nnxscale.errors import ModelError
from nnxscale.models import llama
from nnxscale.models.mixtral import PRESETS, preset


def test_mixtral_8x7b_has_its_published_parameter_counts():
    c = PRESETS["mixtral-8x7b"]
    assert c.num_params() == 46_702_792_704
    assert c.active_params() == 12_879_925_248  # the "12.9B active" of the release


def test_one_expert_of_one_is_a_llama_plus_its_router():
    """With one expert chosen of one, Mixtral's count is Llama's of the same shape plus the router."""
    c = preset("mixtral-tiny", num_local_experts=1, num_experts_per_tok=1)
    same = llama.preset("llama-tiny", hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads)  # fmt: skip
    assert c.num_params() == c.active_params() == same.num_params() + c.num_hidden_layers * c.hidden_size
    moe = PRESETS["mixtral-tiny"]
    assert moe.flops_per_token(128) < 6 * moe.num_params()  # MFU counts the experts a token uses


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(num_experts_per_tok=9), ["num_experts_per_tok=9", "num_local_experts=8"]),
        (dict(num_local_experts=0), ["num_local_experts"]),
        (dict(router_aux_loss_coef=-1.0), ["router_aux_loss_coef", "-1.0"]),
    ],
)
def test_impossible_routing_is_one_clear_error(overrides, words):
    with pytest.raises(ModelError) as e:
        preset("mixtral-tiny", **overrides)
    assert all(w in str(e.value) for w in words), str(e.value)
