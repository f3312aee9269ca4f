"""The Batch API: the state directory's database and lazily opened stores (`state.py`),
uploaded files (`files.py`), batch jobs and their lines (`jobs.py`), the input checks
(`validation.py`), the background runner (`runner.py`), the routes (`routes.py`), the metrics
(`metrics.py`) and `conveyor batch run` (`offline.py`)."""
