"""Compose a target and a proposer in code and compare with target-only decoding.

    python examples/compose.py [TARGET] [DRAFT]      (defaults: the bundled zoo:pycode pair)
"""
import sys

import specplug

target = specplug.Target.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else "zoo:pycode")
options = {"model": sys.argv[2]} if len(sys.argv) > 2 else {}
proposer = specplug.get_proposer("draft-model", target=target, **options)
prompt = "def fibonacci(n):\n    "
greedy = specplug.SamplingParams(temperature=0)

baseline = specplug.generate(target, None, prompt, max_new_tokens=128, sampling=greedy)
result = specplug.generate(target, proposer, prompt, max_new_tokens=128, sampling=greedy, num_speculative_tokens=4)

print(prompt + result.text)
print("identical to target-only greedy:", result.tokens == baseline.tokens)
s = result.stats
print(f"acceptance {s.acceptance_rate:.2f}, {s.mean_acceptance_length:.2f} tokens per target call, "
      f"speed-up {baseline.stats.wall_time / s.wall_time:.2f}x (predicted {s.predicted_speedup:.2f}x)")
