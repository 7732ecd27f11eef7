"""Multi-turn agents: environments, tools and the agent loop, on the explicit API's `SamplingClient`.

`env.py` (what an episode acts in), `rollout.py` (the loop, episodes run concurrently), `samplers.py`
(where actions are sampled), `training_data.py` (trajectories as token sequences with masks), `tools/`
(tool schemas, call parsers, built-in tools, the sandbox), `chat.py` (a chat environment with tools).
"""
