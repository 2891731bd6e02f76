"""Stand-in for the examples' schedule helper: copy MEGAKERNEL_SCHEDULE into
MEGAKERNEL_SCHEDULE_DIR for MEGAKERNEL_SCOPE and print the path it wrote."""

import json
import os
from pathlib import Path

src = json.loads(Path(os.environ["MEGAKERNEL_SCHEDULE"]).read_text())
out = Path(os.environ["MEGAKERNEL_SCHEDULE_DIR"]) / f"dma_order_scope_{os.environ.get('MEGAKERNEL_SCOPE', 'auto')}.json"
out.write_text(json.dumps(src | {"scope": os.environ.get("MEGAKERNEL_SCOPE", "auto")}))
print(out)
