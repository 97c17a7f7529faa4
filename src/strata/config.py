"""EngineConfig: every engine option, validated once."""
