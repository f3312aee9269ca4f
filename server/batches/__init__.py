"""The Batch API's durable state: uploaded files (`files.py`), and the routes of /v1/files."""
