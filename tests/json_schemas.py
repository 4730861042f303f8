"""JSON Schemas the structured-output tests hold answers to."""

# Nested objects, arrays, enums and required fields; strings and arrays bounded so that an
# answer completes well inside the tests' max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "pets": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["cat", "dog", "fish"]},
                    "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                },
                "required": ["kind"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
    },
    "required": ["name", "role", "address", "pets"],
    "additionalProperties": False,
}
