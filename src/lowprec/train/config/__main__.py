"""``python -m lowprec.train.config``: regenerate the CLI's key table from the schema."""

from lowprec.train.config import write_config_keys

print(f"wrote {write_config_keys()}")
