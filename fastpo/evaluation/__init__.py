"""Evaluation on fixed seeds: the policy's success rate and pass@k, and `fastpo eval`.

- policy: the evaluation itself, shared by training and `fastpo eval` (`evaluate_policy`,
  `evaluate_config`; a mixture's games each and weighted, `evaluate_mixture`; the env's random
  and optimal lines, `success_bounds`), and `run_eval`, `fastpo eval` without its command line
  (the public API's `fastpo.evaluate`);
- settings: `fastpo eval`'s configuration, which takes a checkpoint's own settings
  (`eval_config`, `RunSettings`), and its JSON record (`eval_report`); torch-free.

fastpo's own modules import from the module that defines a name.
"""
