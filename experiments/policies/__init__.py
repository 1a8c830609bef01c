"""User-side policies: examples of scheduling policies written outside `paged/`, named on the command line as
`module:Class` (e.g. `--policies=exllamav2,experiments.policies.edf:EarliestDeadlineFirst`)."""
