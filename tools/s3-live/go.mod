module flywheel/tools/s3-live

go 1.25.0

tool github.com/versity/versitygw/cmd/versitygw

require github.com/versity/versitygw v1.8.0
