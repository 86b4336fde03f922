"""DSpark's two heads on the DFlash drafter, written to compute what llama.cpp's dflash graph computes
for a ``DSparkDraftModel`` (src/models/dflash.cpp, the DSpark branch), and their training losses.

Layout: anchor-first (DeepSpec's ``sample_from_anchor``). The block ``[anchor, mask x (B-1)]`` sits
at positions a..a+B-1 and row k (0..B-1) predicts the token at a+k+1, so a block drafts B tokens.

Markov head (DeepSpec's ``VanillaMarkov``): ``markov_w1`` an embedding ``[vocab, rank]`` of the
previous token, ``markov_w2`` a bias-free linear ``rank -> vocab``; row k's logits are the backbone's
plus ``markov_w2 @ markov_w1[prev]``, with prev the token before row k's (the anchor for row 0). At run
time prev is the token drafted for the row before, so the block is a greedy chain from the anchor.

Confidence head (DeepSpec's ``AcceptRatePredictor`` with ``confidence_head_with_markov``): a linear
``hidden + rank -> 1`` (with bias) over ``[h_k; markov_w1[prev]]``, h_k the row's final normed hidden
state; its sigmoid is the drafter's estimate that the target accepts row k's token.

DeepSpec's recipe (deepspec/modeling/dspark/{qwen3/modeling.py, loss.py}, config/dspark): teacher
forcing, prev = the data's own token before each row (the anchor for row 0), so every row is scored
as if the rows before it were accepted, which is what the runtime's confidence means; the block loss
is ``ce_loss_alpha`` x CE + ``l1_loss_alpha`` x L1(draft probs, target probs), both on the biased
logits and weighted by exp(-k/gamma) over rows k = 0..B-1, plus ``confidence_head_alpha`` x BCE of the
confidence logit with the same weights; its published config has markov_rank 256 (hidden 2560),
alphas 0.1 / 0.9 / 1.0 and gamma 4; nothing is detached except the confidence target, so the BCE also
trains the backbone and ``markov_w1``. DeepSpec's confidence target is 1 - TV(draft, target), the
acceptance probability of speculative *sampling*; the demo verifies greedily, where row k is accepted
exactly when its argmax is the target's, so here the target is that indicator (``greedy``; ``tv``
gives DeepSpec's). The demo keeps the DFlash backbone's own loss (the pair's CE, soft labels with
``--soft-labels``) as the block loss, i.e. ``--l1-weight 0`` by default: in a budget of minutes the L1
term, whose gradient vanishes while the draft puts little mass on the target's tokens, trains a fresh
drafter far more slowly than CE (DeepSpec keeps 0.1 CE for the same reason). ``markov_w2`` starts at
zero (the bias starts at zero; ``markov_w1`` unit normal, so ``markov_w2`` learns from the first step).
"""
from __future__ import annotations


def heads_module(H: int, vocab: int, rank: int, confidence: bool):
    """(markov_head, confidence_head or None) with the state-dict names the converter reads."""
    import torch
    import torch.nn as nn

    class MarkovHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.markov_w1 = nn.Embedding(vocab, rank)
            nn.init.normal_(self.markov_w1.weight, std=1.0)
            self.markov_w2 = nn.Linear(rank, vocab, bias=False)
            nn.init.zeros_(self.markov_w2.weight)

        def bias(self, prev):
            return self.markov_w2(self.markov_w1(prev))

    class ConfidenceHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(H + rank, 1)
            nn.init.normal_(self.proj.weight, std=0.02 / (H + rank) ** 0.5)
            nn.init.zeros_(self.proj.bias)

        def forward(self, h, prev_emb):
            return self.proj(torch.cat([h, prev_emb], -1))[..., 0]

    return MarkovHead(), (ConfidenceHead() if confidence else None)


def dspark_loss(model, base_logits, h, prev, labels, wk, *, ce, conf_weight: float, l1_weight: float = 0.0,
                soft=None, conf_target: str = "greedy"):
    """Block loss on the Markov-biased logits plus the confidence BCE.

    base_logits [S, nb, B, V] and h [S, nb, B, H] for block rows 0..B-1; prev [S, nb, B] the token
    before each row's (the anchor, then the sequence's own tokens); labels [S, nb, B] the target's
    greedy tokens; wk [B] the row weights; ``ce(logits)`` -> [S, nb, B] the backbone's CE (hard or soft
    labels); soft = (ids [S, nb, B, J], probs) the target's top tokens, needed by ``l1_weight`` and by
    ``conf_target="tv"``. Returns (loss, the rows' greedy proposals under teacher forcing, confidences
    [S, nb, B] or None, parts).
    """
    import torch
    import torch.nn.functional as F

    logits = base_logits + model.markov_head.bias(prev)
    pred = logits.detach().argmax(-1)
    norm = wk.sum()
    block = (ce(logits) * wk).sum(-1).mean() / norm
    parts = {"ce": block.item()}
    loss = block
    if l1_weight > 0 or (conf_target == "tv" and model.confidence_head is not None):
        tv = _tv(logits, soft)
        if l1_weight > 0:
            l1 = (2.0 * tv * wk).sum(-1).mean() / norm
            loss = loss + l1_weight * l1
            parts["l1"] = l1.item()
    conf = None
    if model.confidence_head is not None:
        z = model.confidence_head(h, model.markov_head.markov_w1(prev))
        target = (pred == labels).float() if conf_target == "greedy" else (1.0 - tv).detach().clamp(0, 1)
        bce = (F.binary_cross_entropy_with_logits(z.float(), target, reduction="none") * wk).sum(-1).mean() / norm
        loss = loss + conf_weight * bce
        conf = torch.sigmoid(z.detach())
        parts["conf"] = bce.item()
    return loss, pred, conf, parts


def _tv(logits, soft):
    """Total variation between the draft's distribution and the target's, from the target's top-J
    tokens: sum over them of |q - p| plus the gap between the masses left outside them (exact when the
    two agree off the top-J, which the J most likely tokens nearly exhaust)."""
    import torch

    if soft is None:
        raise SystemExit("the L1 term and the tv confidence target need the target's distribution: --soft-labels J")
    ids, probs = soft
    q = torch.softmax(logits.float(), -1)
    qj = q.gather(-1, ids)
    p = probs.float()
    return 0.5 * ((qj - p).abs().sum(-1) + ((1 - qj.sum(-1)) - (1 - p.sum(-1))).abs())


def greedy_chain(model, base_logits, h, anchor: int):
    """The runtime's block for one anchor: base_logits [B, V], h [B, H] -> (token ids, confidences)."""
    import torch

    out, conf, prev = [], [], anchor
    for k in range(base_logits.shape[0]):
        p = torch.tensor(prev)
        if model.confidence_head is not None:
            conf.append(float(torch.sigmoid(model.confidence_head(h[k], model.markov_head.markov_w1(p)))))
        prev = int((base_logits[k] + model.markov_head.bias(p)).argmax())
        out.append(prev)
    return out, conf
