"""How often the MTP heads hold the target's next greedy tokens among their top k: what a tree could buy.

    python benchmarks/mtp_topk.py [--head PATH] [--prompts 10] [--max-new-tokens 128]

Decodes HumanEval prompts greedily with the target alone, then runs the heads (as loaded, float32) on the
target's own features along that text: head i at position t should name the token at t + 2 + i. A chain
drafts each head's top 1; a Medusa-style tree would try the top k of each head in one pass, so top-k
accuracy bounds what such a tree could accept (the bundled heads' figures: docs/performance.md).
"""
from __future__ import annotations

import argparse
import copy

import torch

import specplug
from specplug.bench.workloads import humaneval_prompts
from specplug.heads import prefix_features

KS = (1, 2, 3, 4, 6, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="zoo:pycode")
    ap.add_argument("--head", default=None, help="an MTP head directory (default: the target's bundled one)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    target = specplug.Target.from_pretrained(args.target)
    proposer = specplug.get_proposer("mtp", target=target, head=args.head, weights="loaded")
    heads = proposer.heads.float()
    # a float32 copy: the target's own LM head must stay as it decodes
    lm_head = copy.deepcopy(target.lm_head).float() if heads.proj is None else None
    n_heads = heads.num_heads
    hits = [[0] * len(KS) for _ in range(n_heads)]
    counts = [0] * n_heads
    for prompt in humaneval_prompts(args.prompts):
        result = specplug.generate(target, None, prompt, max_new_tokens=args.max_new_tokens,
                                   sampling=specplug.SamplingParams(temperature=0))
        ids = list(result.prompt_ids)
        text = ids + list(result.tokens)
        with torch.inference_mode():
            logits = heads.logits(prefix_features(target, text).float(), lm_head)  # [L, heads, V]
        for i in range(n_heads):
            for t in range(len(ids) - 1, len(text) - 2 - i):  # labels inside the generated text
                top = logits[t, i].topk(max(KS)).indices.tolist()
                label = text[t + 2 + i]
                counts[i] += 1
                for j, k in enumerate(KS):
                    hits[i][j] += label in top[:k]
    print(f"MTP heads on the target's greedy text ({args.prompts} HumanEval prompts × {args.max_new_tokens} tokens)")
    for i in range(n_heads):
        cells = "  ".join(f"top-{k} {hits[i][j] / counts[i]:.2f}" for j, k in enumerate(KS))
        print(f"head {i + 1} (token t+{i + 2}): {cells}   ({counts[i]} positions)")


if __name__ == "__main__":
    main()
