"""Rollout engines that any learner able to write their weight format can feed."""
