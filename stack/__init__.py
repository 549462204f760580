"""Local stack (Kafka, PostgreSQL, MariaDB) that the project starts itself; see stack/local.py."""
