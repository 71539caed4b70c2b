"""Raw access to checkpoint locations, bypassing resilient, for tampering in tests."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path


class LocalStore:
    endpoint = None

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def keys(self, name: str) -> list[str]:
        base = self.root / name
        return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())

    def read(self, name: str, rel: str) -> bytes:
        return (self.root / name / rel).read_bytes()

    def write(self, name: str, rel: str, data: bytes) -> None:
        (self.root / name / rel).write_bytes(data)

    def delete(self, name: str, rel: str) -> None:
        (self.root / name / rel).unlink()

    def clone(self) -> LocalStore:
        dst = self.root.parent / f"{self.root.name}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(self.root, dst)
        return LocalStore(dst)


class S3Store:
    def __init__(self, url: str, endpoint: str) -> None:
        import boto3

        self.url, self.endpoint = url, endpoint
        bucket, _, prefix = url[len("s3://") :].partition("/")
        self.bucket, self.prefix = bucket, prefix.rstrip("/")
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def _key(self, name: str, rel: str = "") -> str:
        return "/".join(p for p in (self.prefix, name, rel) if p)

    def _all(self, prefix: str) -> list[str]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def keys(self, name: str) -> list[str]:
        base = self._key(name) + "/"
        return sorted(k[len(base) :] for k in self._all(base))

    def read(self, name: str, rel: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(name, rel))["Body"].read()

    def write(self, name: str, rel: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(name, rel), Body=data)

    def delete(self, name: str, rel: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(name, rel))

    def clone(self) -> S3Store:
        new_prefix = f"{self.prefix}-{uuid.uuid4().hex[:8]}"
        for key in self._all(self.prefix + "/"):
            dst = new_prefix + key[len(self.prefix) :]
            self.client.copy_object(Bucket=self.bucket, Key=dst, CopySource={"Bucket": self.bucket, "Key": key})
        return S3Store(f"s3://{self.bucket}/{new_prefix}", self.endpoint)
