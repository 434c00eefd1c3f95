"""Table backends behind the one Table protocol."""

from tfde.tables.base import Table, TableCreator
from tfde.tables.cuckoo import CuckooTable, CuckooTableCreator
from tfde.tables.redis_config import RedisTableConfig
from tfde.tables.redis_table import RedisTable, RedisTableCreator
from tfde.tables.reference import ReferenceTable, ReferenceTableCreator

__all__ = [
    "Table",
    "TableCreator",
    "CuckooTable",
    "CuckooTableCreator",
    "ReferenceTable",
    "ReferenceTableCreator",
    "RedisTable",
    "RedisTableConfig",
    "RedisTableCreator",
]
