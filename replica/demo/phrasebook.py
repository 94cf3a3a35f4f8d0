"""Word pools and sentence templates of the demo corpus: one phrasebook per language.

Templates are `str.format` strings over the slots that `corpus` draws for each exchange: company, person, attendee,
product, quantity, unit_price, amount, order_id, invoice_id, meeting_id, date, time, duration, room, topic, eta,
due, restock, carrier, delay_reason, warehouse, available. A scenario lists what users ask, how the assistant answers
without a tool, what it says before calling its tool, and its summaries of the tool result keyed by outcome (the
outcomes a scenario lists are the ones the corpus draws for it). Pools whose entries travel together are tuples of
pairs (a product with its unit price), and delay reasons line up with `DELAY_CODES`, so the JSON a tool returns and
the sentence that reports it always agree.

Japanese is business keigo (お世話になっております, 承知いたしました, ございます); English is plain business prose.
Two system prompts are bilingual and shared by both phrasebooks, so Japanese and English chats share prefixes too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class Scenario:
    """One business situation in one language."""

    name: str
    tool: str | None
    """The function the assistant calls when the conversation uses tools; None: never part of a tool exchange."""
    asks: tuple[str, ...]
    replies: tuple[str, ...]
    """Answers without calling a tool."""
    preambles: tuple[str, ...] = ("",)
    """Assistant text before its tool call ("" is a bare call)."""
    summaries: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """Tool outcome -> answers after the tool result."""


@dataclass(frozen=True, slots=True)
class Phrasebook:
    """Everything language-specific the corpus draws from."""

    language: str
    system_prompts: tuple[str, ...]
    companies: tuple[str, ...]
    people: tuple[str, ...]
    products: tuple[tuple[str, float], ...]
    """(name, unit price in `currency`)."""
    currency: str
    money_format: str
    """Formats `value`, an amount in `currency`."""
    price_format: str
    """Formats `value`, a unit price, as the JSON number a tool call writes for it (no thousands separators, no
    trailing zeros), so the model copies the ask's digits into the arguments."""
    date_format: str
    """Formats `iso` (YYYY-MM-DD), `month` (a name from `months`), `day` and `weekday` (a name from `weekdays`,
    Monday first). It leads with the ISO date, the form tool arguments take, so the model copies it."""
    months: tuple[str, ...]
    weekdays: tuple[str, ...]
    rooms: tuple[str, ...]
    topics: tuple[str, ...]
    room_booking_title: str
    """The meeting title when a room is booked without naming a topic."""
    carriers: tuple[str, ...]
    warehouses: tuple[str, ...]
    delay_reasons: tuple[str, ...]
    """Aligned with `DELAY_CODES`."""
    scenarios: tuple[Scenario, ...]
    thanks: tuple[str, ...]
    """A user's closing turn."""
    welcomes: tuple[str, ...]
    """The assistant's answer to a closing turn."""


DELAY_CODES = ("parts_backorder", "weather", "customs_clearance", "warehouse_congestion")

_SHARED_PROMPTS = (
    "You are the business assistant of Shoal Trading Co., Ltd. (株式会社ショール商事). Answer in the language of the "
    "user: polite business Japanese (敬語) for Japanese, clear business English for English. Use the tools to look up "
    "orders, inventory, invoices and meetings instead of guessing, and summarize each tool result in one or two "
    "sentences.",
    "あなたは株式会社ショール商事の営業アシスタントです。You help the sales team with orders, quotes, invoices and "
    "meeting scheduling. 日本語のご質問には丁寧な敬語で、English questions in English. 金額は税抜で、日付は曜日を添えて"
    "お伝えください。",
)

_JA_ASK_PREAMBLES = ("", "承知いたしました。確認いたします。", "かしこまりました。ただいまシステムで確認いたします。")
_EN_ASK_PREAMBLES = ("", "Sure, let me check.", "Of course. Let me look that up in the system.")

JAPANESE = Phrasebook(
    language="ja",
    system_prompts=(
        *_SHARED_PROMPTS,
        "あなたは株式会社ショール商事の社内業務アシスタントです。受注状況の確認、見積もりの作成、請求書の発行、会議や"
        "会議室の予約をお手伝いします。お客様や社内の方には常に丁寧な敬語でお答えください。不明な点は推測せず、必要に"
        "応じてツールで確認してから回答してください。",
        "あなたは物流・購買部門を支援するAIアシスタントです。納期、在庫、出荷状況に関するお問い合わせに、簡潔かつ丁寧"
        "な日本語でお答えください。遅延が発生している場合は、まずお詫びを申し上げたうえで、原因と新しいお届け予定日を"
        "お伝えください。",
    ),
    companies=(
        "株式会社山田製作所",
        "東邦精機株式会社",
        "株式会社青葉商事",
        "北斗物流株式会社",
        "株式会社みなと電機",
        "大和テクノ株式会社",
        "株式会社桜井工業",
        "富士見フーズ株式会社",
        "株式会社いろは印刷",
        "光洋システム株式会社",
    ),
    people=("田中", "佐藤", "鈴木", "高橋", "伊藤", "渡辺", "山本", "中村", "小林", "加藤", "吉田", "松本"),
    products=(
        ("ステンレスボルトM8", 45),
        ("段ボール箱（中）", 120),
        ("LED照明パネル", 8800),
        ("コピー用紙A4", 2400),
        ("産業用ベアリング", 3600),
        ("制御基板KX-200", 15800),
        ("防水ケーブル5m", 1980),
        ("オフィスチェア", 32000),
    ),
    currency="JPY",
    money_format="{value:,.0f}円",
    price_format="{value:g}円",
    date_format="{iso}（{weekday}）",
    months=tuple(str(month) for month in range(1, 13)),
    weekdays=("月", "火", "水", "木", "金", "土", "日"),
    rooms=("第1会議室", "第2会議室", "大会議室", "応接室A", "応接室B"),
    topics=(
        "新製品の打ち合わせ",
        "来期予算の確認",
        "納期調整の打ち合わせ",
        "定例ミーティング",
        "見積もり内容のご相談",
        "契約更新のご相談",
    ),
    room_booking_title="会議室予約",
    carriers=("ヤマト運輸", "佐川急便", "日本郵便", "西濃運輸"),
    warehouses=("東京", "大阪", "名古屋", "福岡"),
    delay_reasons=("部品の入荷遅れ", "悪天候", "通関手続き", "物流センターの混雑"),
    scenarios=(
        Scenario(
            name="order_status",
            tool="get_order_status",
            asks=(
                "{company}様のご注文（注文番号：{order_id}）の状況を確認していただけますでしょうか。",
                "お世話になっております。注文番号{order_id}の出荷状況を教えていただけますか。",
                "{company}の{person}様から、注文{order_id}がいつ届くかお問い合わせがありました。確認をお願いできますか。",
                "注文番号{order_id}について、現在のステータスを確認してください。",
            ),
            replies=(
                "承知いたしました。ご注文{order_id}は現在出荷準備中で、{eta}にお届けの予定でございます。",
                "ご確認ありがとうございます。注文番号{order_id}は{eta}に到着予定となっております。変更がございましたら"
                "改めてご連絡いたします。",
                "お問い合わせいただきありがとうございます。{order_id}につきましては、{eta}のお届けを予定しております。",
            ),
            preambles=(*_JA_ASK_PREAMBLES, "承知いたしました。注文状況を確認いたします。"),
            summaries=MappingProxyType(
                {
                    "shipped": (
                        "確認いたしました。ご注文{order_id}は出荷済みで、{carrier}にて{eta}にお届け予定でございます。",
                        "ご注文{order_id}はすでに発送されております。お届け予定日は{eta}、配送業者は{carrier}です。",
                    ),
                    "processing": (
                        "ご注文{order_id}は現在出荷準備中でございます。{eta}にお届けの予定です。",
                        "確認いたしました。{order_id}は倉庫にて準備中で、お届け予定日は{eta}となっております。",
                    ),
                    "delayed": (
                        "大変申し訳ございません。ご注文{order_id}は{delay_reason}のため遅れており、お届けは{eta}の見込み"
                        "でございます。",
                        "確認いたしました。{delay_reason}により{order_id}の出荷が遅延しております。新しいお届け予定日は"
                        "{eta}です。{company}様へのご連絡をお手伝いいたしましょうか。",
                    ),
                }
            ),
        ),
        Scenario(
            name="shipping_delay",
            tool="get_order_status",
            asks=(
                "{company}様より、注文{order_id}の納期が遅れているとのご連絡がありました。状況を確認していただけますか。",
                "注文番号{order_id}の商品がまだ届いていないそうです。至急確認をお願いいたします。",
                "{product}の納品が予定より遅れているようです。注文番号は{order_id}です。",
            ),
            replies=(
                "ご迷惑をおかけして大変申し訳ございません。{order_id}は{delay_reason}のため出荷が遅れており、{eta}に"
                "お届けできる見込みでございます。",
                "大変申し訳ございません。ただいま物流部に確認しております。判明次第、{company}様へご連絡いたします。",
                "ご不便をおかけしております。納期につきましては{eta}を目処に調整しております。何卒ご理解のほど"
                "よろしくお願い申し上げます。",
            ),
            preambles=(*_JA_ASK_PREAMBLES, "ご迷惑をおかけしております。出荷状況を確認いたします。"),
            summaries=MappingProxyType(
                {
                    "delayed": (
                        "確認いたしました。{order_id}は{delay_reason}のため遅延しており、新しいお届け予定日は{eta}で"
                        "ございます。{company}様へのお詫びのご連絡文を作成いたしましょうか。",
                        "大変申し訳ございません。{delay_reason}の影響で{order_id}の出荷が遅れております。{eta}には"
                        "お届けできる見込みです。",
                    ),
                    "shipped": (
                        "確認いたしました。{order_id}はすでに出荷済みで、{carrier}にて配送中でございます。{eta}には"
                        "お届けできる見込みです。",
                    ),
                }
            ),
        ),
        Scenario(
            name="meeting",
            tool="schedule_meeting",
            asks=(
                "{date}の{time}から{duration}分、{company}の{person}様との{topic}を設定していただけますか。",
                "{person}様と{topic}を行いたいので、{date} {time}で会議を予約してください。",
                "{date}、{time}から{topic}を入れてください。参加者は{person}様と{attendee}さんです。",
            ),
            replies=(
                "承知いたしました。{date} {time}から{duration}分、{topic}を設定いたします。{person}様へ招待状を"
                "お送りしてもよろしいでしょうか。",
                "かしこまりました。{date}の{time}で調整いたします。参加者の皆様にご案内をお送りいたします。",
            ),
            preambles=(*_JA_ASK_PREAMBLES, "承知いたしました。会議を設定いたします。"),
            summaries=MappingProxyType(
                {
                    "confirmed": (
                        "会議を設定いたしました。{date} {time}から{duration}分、場所は{room}です"
                        "（会議ID：{meeting_id}）。",
                        "{topic}のご予約が完了いたしました。日時は{date} {time}、会議室は{room}でございます。",
                    ),
                }
            ),
        ),
        Scenario(
            name="room_booking",
            tool="schedule_meeting",
            asks=(
                "{date}の{time}から{room}を{duration}分予約していただけますか。",
                "{topic}のために会議室を押さえたいです。{date} {time}から{room}は空いていますでしょうか。",
                "会議室予約をお願いします。{date}、{time}開始で{duration}分、{room}を希望します。",
            ),
            replies=(
                "承知いたしました。{date} {time}から{room}を{duration}分お取りいたします。",
                "かしこまりました。{room}の予約を承りました。当日は開始5分前までにご入室ください。",
            ),
            preambles=(*_JA_ASK_PREAMBLES, "承知いたしました。会議室の空き状況を確認いたします。"),
            summaries=MappingProxyType(
                {
                    "confirmed": (
                        "{room}のご予約が完了いたしました。{date} {time}から{duration}分でございます"
                        "（予約ID：{meeting_id}）。",
                        "会議室予約を承りました。{date} {time}より{room}をご利用いただけます。",
                    ),
                }
            ),
        ),
        Scenario(
            name="invoice",
            tool="create_invoice",
            asks=(
                "{company}様宛てに、{product} {quantity}個分の請求書を作成してください。単価は{unit_price}です。",
                "請求書の発行をお願いします。取引先は{company}様、品目は{product}、数量{quantity}、単価{unit_price}、"
                "支払期日は{due}です。",
                "{company}の{person}様から請求書の送付依頼がありました。{product}を{quantity}個、単価{unit_price}で"
                "お願いいたします。",
            ),
            replies=(
                "承知いたしました。{company}様宛ての請求書（{product} {quantity}個、合計{amount}）を作成いたします。"
                "お支払い期日は{due}とさせていただきます。",
                "かしこまりました。合計金額は{amount}（税抜）となります。作成後、{person}様へPDFでお送りいたします。",
            ),
            preambles=(*_JA_ASK_PREAMBLES, "承知いたしました。請求書を作成いたします。"),
            summaries=MappingProxyType(
                {
                    "issued": (
                        "請求書を作成いたしました。請求書番号は{invoice_id}、合計金額は{amount}、お支払い期日は{due}で"
                        "ございます。",
                        "{company}様宛ての請求書{invoice_id}を発行いたしました。ご請求金額は{amount}（税抜）です。",
                    ),
                }
            ),
        ),
        Scenario(
            name="quote",
            tool="check_inventory",
            asks=(
                "{company}様から{product} {quantity}個のお見積もり依頼がありました。在庫を確認していただけますか。",
                "{product}を{quantity}個、見積もりを作成したいのですが、納期はいつ頃になりますでしょうか。",
                "見積もりのご依頼です。{product}、数量{quantity}個でお願いいたします。",
            ),
            replies=(
                "承知いたしました。{product} {quantity}個のお見積もり金額は{amount}（税抜）でございます。納期は"
                "ご注文から約1週間を予定しております。",
                "お見積もりのご依頼ありがとうございます。単価{unit_price}、合計{amount}にてご案内いたします。"
                "有効期限は発行日から30日間です。",
            ),
            preambles=(*_JA_ASK_PREAMBLES, "承知いたしました。まず在庫を確認いたします。"),
            summaries=MappingProxyType(
                {
                    "in_stock": (
                        "在庫を確認いたしました。{product}は{warehouse}倉庫に{available}個ございますので、{quantity}個の"
                        "お見積もりは{amount}（税抜）、{eta}の納品が可能です。",
                    ),
                    "insufficient": (
                        "確認いたしました。{product}の在庫は{available}個のため、{quantity}個のご用意には{restock}の入荷を"
                        "待つ必要がございます。お見積もり金額は{amount}（税抜）です。",
                    ),
                }
            ),
        ),
        Scenario(
            name="inventory",
            tool="check_inventory",
            asks=(
                "{product}の在庫は{quantity}個ありますか。",
                "{warehouse}倉庫の{product}の在庫数を確認してください。{quantity}個必要です。",
                "{company}様向けに{product}を{quantity}個出荷したいのですが、在庫は足りていますでしょうか。",
            ),
            replies=(
                "確認いたします。{product}は通常{warehouse}倉庫に在庫がございますが、正確な数量は在庫システムにて"
                "ご確認ください。",
                "恐れ入りますが、{product}の在庫数は物流部にお問い合わせいただけますでしょうか。",
            ),
            preambles=_JA_ASK_PREAMBLES,
            summaries=MappingProxyType(
                {
                    "in_stock": (
                        "{product}は{warehouse}倉庫に{available}個の在庫がございます。{quantity}個の出荷は問題ございません。",
                    ),
                    "insufficient": (
                        "申し訳ございません。{product}の在庫は{warehouse}倉庫に{available}個のみでございます。次回入荷予定は"
                        "{restock}です。",
                    ),
                }
            ),
        ),
        Scenario(
            name="thank_you_email",
            tool=None,
            asks=(
                "{company}の{person}様へ、先日の打ち合わせのお礼メールを作成してください。",
                "{person}様に、打ち合わせのお礼をメールでお伝えしたいです。文面をお願いできますか。",
            ),
            replies=(
                "{company}\n{person}様\n\nいつも大変お世話になっております。\n先日はお忙しい中、打ち合わせのお時間を"
                "いただき誠にありがとうございました。\n引き続きどうぞよろしくお願い申し上げます。",
            ),
        ),
        Scenario(
            name="scheduling_email",
            tool=None,
            asks=(
                "{person}様宛てに、{topic}の日程調整をお願いするメールの文面を考えていただけますか。",
                "{company}の{person}様に{topic}の候補日をお伺いするメールを作成してください。",
            ),
            replies=(
                "{person}様\n\nいつもお世話になっております。\n{topic}につきまして、{date} {time}はご都合いかがで"
                "しょうか。\nご検討のほど、よろしくお願いいたします。",
            ),
        ),
    ),
    thanks=(
        "ありがとうございます。助かりました。",
        "承知しました。引き続きよろしくお願いします。",
        "ありがとうございました。",
    ),
    welcomes=(
        "どういたしまして。他にもお手伝いできることがございましたら、お気軽にお申し付けください。",
        "とんでもございません。引き続きどうぞよろしくお願いいたします。",
    ),
)

ENGLISH = Phrasebook(
    language="en",
    system_prompts=(
        *_SHARED_PROMPTS,
        "You are the operations assistant for Shoal Trading. You help staff check order status, inventory levels and "
        "invoices, and you schedule meetings and conference rooms. Be concise and professional. Use the available "
        "tools instead of guessing, and confirm dates, quantities and amounts back to the user.",
        "You are a customer support assistant for a B2B supplier. Answer questions about orders, deliveries, quotes "
        "and billing in clear, friendly business English. If a shipment is delayed, apologize, explain the reason and "
        "give the new delivery date.",
    ),
    companies=(
        "Northwind Traders",
        "Acme Logistics",
        "Blue Harbor Foods",
        "Summit Components",
        "Greenfield Office Supply",
        "Redwood Machining",
        "Lakeside Textiles",
        "Silverline Electronics",
        "Harbor & Pine Co.",
        "Crestview Labs",
    ),
    people=(
        "Emily Carter",
        "James Miller",
        "Sarah Johnson",
        "David Brown",
        "Olivia Wilson",
        "Michael Davis",
        "Priya Patel",
        "Daniel Kim",
        "Laura Chen",
        "Robert Garcia",
    ),
    products=(
        ("M8 stainless bolts", 0.35),
        ("medium shipping boxes", 1.20),
        ("LED panel lights", 64.00),
        ("A4 copy paper (case)", 18.50),
        ("industrial bearings", 27.00),
        ("KX-200 control boards", 119.00),
        ("waterproof cables (5 m)", 14.90),
        ("ergonomic office chairs", 245.00),
    ),
    currency="USD",
    money_format="${value:,.2f}",
    price_format="${value:g}",
    date_format="{iso} ({weekday})",
    months=(
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ),
    weekdays=("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
    rooms=("Conference Room A", "Conference Room B", "Board Room", "Huddle Room 3", "Training Room"),
    topics=(
        "Q3 budget review",
        "new product kickoff",
        "delivery schedule alignment",
        "weekly sync",
        "contract renewal discussion",
        "quote review",
    ),
    room_booking_title="Room booking",
    carriers=("UPS", "FedEx", "DHL", "USPS"),
    warehouses=("Chicago", "Dallas", "Newark", "Seattle"),
    delay_reasons=("a parts backorder", "bad weather", "customs clearance", "congestion at the warehouse"),
    scenarios=(
        Scenario(
            name="order_status",
            tool="get_order_status",
            asks=(
                "Could you check the status of order {order_id} for {company}?",
                "Hi, {person} from {company} is asking when order {order_id} will arrive. Can you look into it?",
                "What's the current status of order {order_id}?",
                "Please check where order {order_id} is.",
            ),
            replies=(
                "Order {order_id} is being prepared for shipment and should arrive on {eta}.",
                "Thanks for checking in. Order {order_id} is scheduled for delivery on {eta}. I'll let you know if "
                "anything changes.",
            ),
            preambles=(*_EN_ASK_PREAMBLES, "Sure, let me check the order status."),
            summaries=MappingProxyType(
                {
                    "shipped": (
                        "Order {order_id} has shipped with {carrier} and is expected to arrive on {eta}.",
                        "Good news: order {order_id} is on its way via {carrier}. Estimated delivery is {eta}.",
                    ),
                    "processing": (
                        "Order {order_id} is still being processed at the warehouse. It should be delivered on {eta}.",
                        "Order {order_id} hasn't shipped yet; it's being packed now and should arrive on {eta}.",
                    ),
                    "delayed": (
                        "I'm sorry, order {order_id} is delayed due to {delay_reason}. The new estimated delivery "
                        "date is {eta}.",
                        "Order {order_id} has been held up by {delay_reason}. We now expect delivery on {eta}. "
                        "Would you like me to draft an update for {person}?",
                    ),
                }
            ),
        ),
        Scenario(
            name="shipping_delay",
            tool="get_order_status",
            asks=(
                "{company} says order {order_id} is late. Can you find out what happened?",
                "The {product} on order {order_id} still haven't arrived. Please check urgently.",
                "{person} at {company} is asking why order {order_id} is delayed.",
            ),
            replies=(
                "I'm sorry for the trouble. Order {order_id} was delayed by {delay_reason} and should now arrive on "
                "{eta}.",
                "Apologies for the delay. I've asked the logistics team to check and will update {company} as soon as "
                "I hear back.",
            ),
            preambles=(*_EN_ASK_PREAMBLES, "Sorry about that. Let me check the shipment."),
            summaries=MappingProxyType(
                {
                    "delayed": (
                        "Order {order_id} is delayed due to {delay_reason}. The new delivery date is {eta}. "
                        "Shall I draft an apology email to {company}?",
                        "I'm sorry, {delay_reason} has held up order {order_id}. It should arrive by {eta}.",
                    ),
                    "shipped": (
                        "Order {order_id} has actually shipped and is in transit with {carrier}. It should arrive by "
                        "{eta}.",
                    ),
                }
            ),
        ),
        Scenario(
            name="meeting",
            tool="schedule_meeting",
            asks=(
                "Please set up a {duration}-minute {topic} with {person} from {company} on {date} at {time}.",
                "Can you book a meeting with {person} on {date} at {time} for the {topic}?",
                "Schedule the {topic} for {date}, {time}. Attendees are {person} and {attendee}.",
            ),
            replies=(
                "Got it. I'll set up the {topic} on {date} at {time} for {duration} minutes and send {person} an "
                "invitation.",
                "Sure. {date} at {time} works; I'll send the invitations to everyone.",
            ),
            preambles=(*_EN_ASK_PREAMBLES, "Sure, I'll schedule that."),
            summaries=MappingProxyType(
                {
                    "confirmed": (
                        "The meeting is booked for {date} at {time} ({duration} minutes) in {room}. Meeting ID: "
                        "{meeting_id}.",
                        "Done. The {topic} is scheduled for {date} at {time} in {room}.",
                    ),
                }
            ),
        ),
        Scenario(
            name="room_booking",
            tool="schedule_meeting",
            asks=(
                "Can you reserve {room} on {date} from {time} for {duration} minutes?",
                "I need a room for the {topic}. Is {room} free on {date} at {time}?",
                "Please book {room} for {duration} minutes starting {time} on {date}.",
            ),
            replies=(
                "Sure. I'll hold {room} on {date} from {time} for {duration} minutes.",
                "Done. {room} is reserved for you; please check in a few minutes before the start.",
            ),
            preambles=(*_EN_ASK_PREAMBLES, "Let me check the room availability."),
            summaries=MappingProxyType(
                {
                    "confirmed": (
                        "{room} is booked for {date} from {time} for {duration} minutes (booking ID {meeting_id}).",
                        "Your reservation is confirmed: {room}, {date} at {time}.",
                    ),
                }
            ),
        ),
        Scenario(
            name="invoice",
            tool="create_invoice",
            asks=(
                "Please create an invoice for {company}: {quantity} {product} at {unit_price} each.",
                "I need an invoice for {company}. Item: {product}, quantity {quantity}, unit price {unit_price}, due "
                "{due}.",
                "{person} at {company} asked for an invoice for {quantity} {product} at {unit_price} per unit.",
            ),
            replies=(
                "Sure. I'll prepare an invoice to {company} for {quantity} {product}, {amount} in total, due {due}.",
                "Got it. The total comes to {amount} before tax. I'll email the PDF to {person} once it's ready.",
            ),
            preambles=(*_EN_ASK_PREAMBLES, "Sure, I'll create the invoice."),
            summaries=MappingProxyType(
                {
                    "issued": (
                        "The invoice has been created. Invoice number {invoice_id}, total {amount}, due {due}.",
                        "Invoice {invoice_id} to {company} is issued for {amount} before tax.",
                    ),
                }
            ),
        ),
        Scenario(
            name="quote",
            tool="check_inventory",
            asks=(
                "{company} asked for a quote on {quantity} {product}. Can you check stock first?",
                "I'd like to quote {quantity} {product}. How soon could we deliver?",
                "New quote request: {product}, quantity {quantity}.",
            ),
            replies=(
                "A quote for {quantity} {product} comes to {amount} before tax, with delivery about one week after "
                "the order.",
                "Thanks for the request. At {unit_price} per unit, the total is {amount}. The quote is valid for 30 "
                "days.",
            ),
            preambles=(*_EN_ASK_PREAMBLES, "Let me check inventory first."),
            summaries=MappingProxyType(
                {
                    "in_stock": (
                        "We have {available} {product} in the {warehouse} warehouse, so the quote for {quantity} is "
                        "{amount} before tax with delivery by {eta}.",
                    ),
                    "insufficient": (
                        "Only {available} {product} are in stock, so the full {quantity} would ship after the "
                        "restock on {restock}. The quote is {amount} before tax.",
                    ),
                }
            ),
        ),
        Scenario(
            name="inventory",
            tool="check_inventory",
            asks=(
                "Do we have {quantity} {product} in stock?",
                "How many {product} are in the {warehouse} warehouse? I need {quantity}.",
                "I want to ship {quantity} {product} to {company}. Is there enough stock?",
            ),
            replies=(
                "We usually stock {product} in the {warehouse} warehouse, but please check the inventory system for "
                "exact numbers.",
                "I'd recommend confirming the {product} count with the logistics team before promising a date.",
            ),
            preambles=_EN_ASK_PREAMBLES,
            summaries=MappingProxyType(
                {
                    "in_stock": (
                        "There are {available} {product} in the {warehouse} warehouse, so shipping {quantity} is no "
                        "problem.",
                    ),
                    "insufficient": (
                        "Sorry, only {available} {product} are left in the {warehouse} warehouse. The next restock is "
                        "{restock}.",
                    ),
                }
            ),
        ),
        Scenario(
            name="thank_you_email",
            tool=None,
            asks=(
                "Please draft a thank-you email to {person} at {company} for yesterday's meeting.",
                "I'd like to thank {person} for the meeting. Could you write the email?",
            ),
            replies=(
                "Dear {person},\n\nThank you for taking the time to meet with us yesterday. We appreciate your "
                "support and look forward to working with {company}.\n\nBest regards,",
            ),
        ),
        Scenario(
            name="scheduling_email",
            tool=None,
            asks=(
                "Can you write a short email asking {person} for a time for the {topic}?",
                "Please draft an email to {person} at {company} proposing a slot for the {topic}.",
            ),
            replies=(
                "Dear {person},\n\nWould {date} at {time} work for the {topic}? Please let me know if another time "
                "suits you better.\n\nBest regards,",
            ),
        ),
    ),
    thanks=("Thanks, that helps.", "Great, thank you!", "Perfect, thanks."),
    welcomes=("You're welcome. Let me know if there's anything else I can do.", "Happy to help!"),
)

PHRASEBOOKS = (JAPANESE, ENGLISH)
