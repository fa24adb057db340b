"""Integrations with other tools: the lm-evaluation-harness adapter and its start-up hook, and the
Monte-Carlo log-likelihood used for multiple-choice tasks."""
