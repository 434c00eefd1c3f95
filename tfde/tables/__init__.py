"""Table backends behind the one Table protocol."""

from tfde.tables.base import Table, TableCreator
from tfde.tables.cuckoo import CuckooTable, CuckooTableCreator
from tfde.tables.reference import ReferenceTable, ReferenceTableCreator

__all__ = ["Table", "TableCreator", "CuckooTable", "CuckooTableCreator", "ReferenceTable",
           "ReferenceTableCreator"]
