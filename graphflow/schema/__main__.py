"""``python -m graphflow.schema > graphflow/schema/plan.schema.json``: write the plan schema."""

import sys

from graphflow.schema import schema_json

sys.stdout.write(schema_json())
