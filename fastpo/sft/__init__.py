"""Imitation learning: supervised fine-tuning on expert trajectories or conversations (`fastpo
sft`, the RAGEN paper's SFT baseline, arXiv 2504.20073, appendix) and DAgger rounds on the
states the model reaches (`fastpo dagger`).

    fastpo sft --env sokoban                      # -> runs/sft-sokoban (an HF model in its checkpoints)
    fastpo train --env sokoban --model runs/sft-sokoban

    cfg = load_config(env="sokoban", preset="tiny", sections=("sft",), overrides=["sft.trajectories=64"])
    SFTTrainer(cfg).run()

The modules, one concern each:

- config: what the commands add to the one configuration (fastpo.config, whose `sft` and
  `dagger` sections hold their settings): their defaults over the presets, the preset a new
  run takes (the game recipes), the StarPO hand-off command;
- experts: the expert's trajectories rendered as a rollout renders a model's
  (`expert_rollout`, `ExpertEngine`: the game's own `expert`, built-in or yours, no game
  named), and the imitation metric (`first_action_accuracy`);
- data: a run's data read before any model loads (`load_sft_data`): the expert's
  trajectories or a JSONL file of conversations (`read_chat_file`) and its checks;
- trainer: `SFTTrainer`, on the StarPO trainer's parts and run loop;
- labels: DAgger's labels of the states a model reached (`label_trajectories`) and their
  conversations (`labelled_conversations`);
- dagger: the `fastpo dagger` run (`DaggerRun`: rounds, resumable chunk by chunk).

The names below are the package's public API; fastpo's own modules import from the module
that defines a name.
"""
from fastpo.sft.config import SFT_DEFAULT_OVERRIDES, handoff_command, sft_default_overrides
from fastpo.sft.data import SFTData, chat_ids_and_mask, load_sft_data, read_chat_file
from fastpo.sft.experts import ExpertEngine, expert_answer_text, expert_rollout, first_action_accuracy
from fastpo.sft.trainer import SFTTrainer, batch_indices
from fastpo.sft.labels import label_trajectories, labelled_conversations
from fastpo.sft.dagger import DaggerRun

__all__ = ["DaggerRun", "ExpertEngine", "SFTData", "SFTTrainer", "SFT_DEFAULT_OVERRIDES", "batch_indices",
           "chat_ids_and_mask", "expert_answer_text", "expert_rollout", "first_action_accuracy", "handoff_command",
           "label_trajectories", "labelled_conversations", "load_sft_data", "read_chat_file", "sft_default_overrides"]
