"""heads attention inside PyTorch training: a torch.autograd.Function whose forward and backward
both run in heads (C++), so a PyTorch model can swap it in for F.scaled_dot_product_attention.

    from heads.torch import scaled_dot_product_attention as sdpa
    out = sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    out.sum().backward()          # q.grad, k.grad, v.grad (and a float attn_mask's grad)

float32 CPU tensors. Dropout draws its mask in heads (seeded by heads.manual_seed); the backward
reuses exactly the forward's mask. Rows that can attend to nothing give zeros and zero gradients.
"""

import torch as _torch

from . import _heads

__all__ = ["scaled_dot_product_attention", "SDPAFunction"]


def _c(x):
    return None if x is None else x.detach()


class SDPAFunction(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        out, lse, seed = _heads.sdpa_train_forward(_c(query), _c(key), _c(value), _c(attn_mask),
                                                   float(dropout_p), bool(is_causal), scale, bool(enable_gqa))
        out = out.reshape(query.shape[:-1] + (value.shape[-1],))
        ctx.save_for_backward(query, key, value, out, lse, attn_mask if attn_mask is not None else _torch.empty(0))
        ctx.args = (seed, attn_mask is not None, float(dropout_p), bool(is_causal), scale, bool(enable_gqa))
        return out

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out, lse, mask = ctx.saved_tensors
        seed, has_mask, dropout_p, is_causal, scale, enable_gqa = ctx.args
        mask = mask if has_mask else None
        mask_grad = bool(has_mask and mask.is_floating_point() and ctx.needs_input_grad[3])
        dq, dk, dv, dm = _heads.sdpa_train_backward(
            dout.contiguous(), _c(query), _c(key), _c(value), out, lse, seed, _c(mask), dropout_p, is_causal,
            scale, enable_gqa, mask_grad)
        return (dq.reshape(query.shape), dk.reshape(key.shape), dv.reshape(value.shape),
                dm if mask_grad else None, None, None, None, None)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """As torch.nn.functional.scaled_dot_product_attention, computed by heads (forward and backward)."""
    return SDPAFunction.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
