"""Downstream evaluation of a checkpoint at any layout (`mesh3d eval`, README "Evaluation").

`scorer.py` turns token sequences into log-likelihoods and greedy continuations on the model
built as training builds it (`generation/parallel.py`: tp x pp, each rank its own weights);
`lm_eval_model.py` is that scorer as an lm-evaluation-harness model and `lighteval_model.py` as
a lighteval model (`lighteval_tasks.py` picks lighteval's tasks without its registry,
`lighteval_run.py` runs its pipeline); `cli.py` the command, `in_run.py` the evaluation inside
a run. The engines are optional (`pip install mesh3d[eval]`): a plain training run never
imports them.
"""
