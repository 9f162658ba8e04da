"""The wing of tools around the product: CLI, demo, launcher, test harness, bench. The product never imports it."""
