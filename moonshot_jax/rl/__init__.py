"""Agentic RL on AgentEnv: GRPO math (grpo.py), batched multi-turn rollouts (rollout.py), and the
batch source that runs SFT / GRPO through launch/train.py's loop (source.py)."""
