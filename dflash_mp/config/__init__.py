"""The configuration: each group's fields (fields.py), the root schema and its composition
(schema.py), every check of a composed config before any process does work (validation.py), and
the mask token a config resolves to against its target (mask_token.py). Free of torch imports: the
launcher reads configs before anything heavy."""
