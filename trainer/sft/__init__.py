"""The SFT program (``emapg sft``): warm-start a search agent on trajectories, observations masked out of the
loss. Its own config (:mod:`trainer.sft.config`), data (:mod:`trainer.sft.data`) and loop
(:mod:`trainer.sft.train`); it shares the policy's model forward (:mod:`trainer.model_forward`) with RL.
"""
