"""``python -m graphflow.plan.schema > graphflow/plan/schema/plan.schema.json``: write the plan schema."""

import sys

from graphflow.plan.schema import schema_json

sys.stdout.write(schema_json())
