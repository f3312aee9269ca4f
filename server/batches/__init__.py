"""The Batch API: uploaded files (`files.py`), batch jobs and their lines (`jobs.py`), the input
checks (`validation.py`), the background runner (`runner.py`) and the routes (`routes.py`)."""
