"""DFlash2's two additions to the drafter, written to compute what llama.cpp's dflash graph computes
(src/models/dflash.cpp: ``build_dflash2_conv``, ``build_dflash2_selector``), and the selector's
training loss.

Grouped dynamic causal conv, around both sublayers of every layer. A projection of the sublayer's
normed input gives, per position and per group of ``group`` channels, ``kernel`` coefficients for
each side (0: the sublayer's input, 1: its output); a channel's weight for tap t at position p is
``base[side, t, c] + dynamic[p, side, t, c // group]`` and the conv reads ``x[p - t]`` within the
block (zero before its first row). Projection rows are ordered (side, tap, group), the layout of
``kernel_projection.weight`` that llama.cpp reads unpermuted.

Candidate selector. Row k of a block keeps the ``top_k`` tokens of its logits; the score of
candidate b after token a is ``logit(b) + <prev[a] * (W_h h_k), next[b]>`` with ``h_k`` the row's
normed final hidden state. At T = 0 the runtime walks the argmax path from the anchor; at T > 0
row k's proposal distribution is softmax(score / T) over its candidates.

Training objective (not published by the authors; this one follows the block CE + K-way selector CE
that Speculators and NeMo describe): the candidate set is the detached top-k of the row's logits,
the predecessor is the true previous token (the anchor for row 1), and the target is the target
model's distribution restricted to the candidates (soft labels), or the target's greedy token when
it is among them (hard labels).
"""
from __future__ import annotations


def conv_modules(H: int, kernel: int, group: int):
    """(base_kernel [2, K, H], kernel_projection Linear(H, 2 * K * H / group)) for one sublayer."""
    import torch
    import torch.nn as nn

    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.base_kernel = nn.Parameter(torch.zeros(2, kernel, H))
            self.base_kernel.data[:, 0] = 1.0          # identity at the start: tap 0 passes x through
            self.kernel_projection = nn.Linear(H, 2 * kernel * (H // group), bias=False)
            nn.init.normal_(self.kernel_projection.weight, std=0.02 / H ** 0.5)

        def coefficients(self, x):
            return self.kernel_projection(x)

        def forward(self, x, dyn, side: int, block: int):
            """x [S, T, H] (T = n_blocks * block, blocks contiguous), dyn [S, T, 2*K*G] -> [S, T, H]."""
            S, T, _ = x.shape
            d = dyn.view(S, T, 2, kernel, H // group)[:, :, side].repeat_interleave(group, -1)   # [S, T, K, H]
            w = (d + self.base_kernel[side]).view(S, T // block, block, kernel, H)
            xb = x.view(S, T // block, block, H)
            out = w[:, :, :, 0] * xb
            for t in range(1, min(kernel, block)):
                shifted = torch.nn.functional.pad(xb[:, :, :block - t], (0, 0, t, 0))
                out = out + w[:, :, :, t] * shifted
            return out.view(S, T, H)

    return Conv


def selector_module(H: int, vocab: int, rank: int):
    import torch
    import torch.nn as nn

    class CandidateSelector(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden_projection = nn.Linear(H, rank, bias=False)
            self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
            self.successor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)

        def scores(self, logits, h, pred, cand):
            """logits [..., V], h [..., H], pred [...] (token ids), cand [..., K] -> [..., K]."""
            gate = self.hidden_projection(h)                                   # [..., r]
            cond = self.predecessor_codebook[pred] * gate                      # [..., r]
            pair = (self.successor_codebook[cand] * cond[..., None, :]).sum(-1)   # [..., K]
            return logits.gather(-1, cand) + pair

    return CandidateSelector


def selector_loss(sel, logits, h, prev, labels, top_k: int, soft=None):
    """K-way CE of the selector over each row's detached top-k.

    logits [S, nb, B-1, V] and h [S, nb, B-1, H] for block rows 1..B-1; prev [S, nb, B-1] the token
    before each row's (the anchor for row 1, then the sequence's own tokens); labels [S, nb, B-1]
    (the target's greedy tokens); soft = (ids [S, nb, B-1, J], probs [...]) or None.
    Returns (mean loss over rows with any target mass among the candidates, share of such rows, the
    teacher-forced walk's proposal per row: the candidate with the best score after the true previous
    token).
    """
    import torch

    cand = logits.detach().topk(top_k, -1).indices                            # [S, nb, B-1, K]
    sc = sel.scores(logits, h, prev, cand)
    if soft is None:
        tgt = (cand == labels[..., None]).float()
    else:
        ids, probs = soft
        tgt = ((cand[..., :, None] == ids[..., None, :]).float() * probs[..., None, :].float()).sum(-1)
    pred = cand.gather(-1, sc.detach().argmax(-1, keepdim=True))[..., 0]
    mass = tgt.sum(-1)
    ok = mass > 1e-3
    if not ok.any():
        return sc.sum() * 0.0, 0.0, pred
    tgt = tgt[ok] / mass[ok][:, None]
    loss = -(tgt * torch.log_softmax(sc[ok].float(), -1)).sum(-1).mean()
    return loss, ok.float().mean().item(), pred


def greedy_walk(sel, logits, h, anchor: int, top_k: int):
    """The runtime's T = 0 proposal for one block: logits [B-1, V], h [B-1, H] -> token ids [B-1]."""
    import torch

    out, pred = [], anchor
    cand = logits.topk(top_k, -1).indices
    for k in range(logits.shape[0]):
        sc = sel.scores(logits[k], h[k], torch.tensor(pred), cand[k])
        pred = int(cand[k, int(sc.argmax())])
        out.append(pred)
    return out
